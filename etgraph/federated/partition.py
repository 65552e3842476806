"""Splitting one dataset's training examples among federated clients (issue 29).

* ``iid`` — a random permutation cut into ``n`` near-equal parts;
* ``dirichlet:ALPHA`` — label skew as in Hsu et al. 2019 ("Measuring the effects of non-identical
  data distribution", arXiv 1909.06335): for every class, the shares of its examples going to the
  ``n`` clients are drawn from ``Dirichlet(ALPHA * 1_n)``; small ``ALPHA`` (0.5 is the usual
  benchmark setting) gives each client few classes. Draws are repeated (from the same seeded
  generator) until every client holds at least ``min_examples``.

Pure numpy; the same ``(labels, n, scheme, seed)`` gives the same split on every process, so a
client computes its own part from its partition id without the server sending data.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError

__all__ = ["MAX_DRAWS", "parse_partition", "partition"]

#: Dirichlet draws tried before giving up on ``min_examples`` per client.
MAX_DRAWS = 1000


def parse_partition(text: str) -> tuple[str, float | None]:
    """``("iid", None)`` or ``("dirichlet", alpha)`` of ``--partition`` text.

    Raises:
        ConfigError: neither ``iid`` nor ``dirichlet:ALPHA`` with ALPHA > 0.
    """
    t = str(text).strip().lower()
    if t == "iid":
        return "iid", None
    if t.startswith("dirichlet:"):
        try:
            alpha = float(t.split(":", 1)[1])
        except ValueError:
            alpha = float("nan")
        if 0 < alpha < float("inf"):
            return "dirichlet", alpha
    raise ConfigError(f"--partition {text!r}: use iid or dirichlet:ALPHA (ALPHA > 0, e.g. 0.5)")


def partition(
    labels: np.ndarray, n_clients: int, scheme: str, *, seed: int = 0, min_examples: int = 1
) -> list[np.ndarray]:
    """Split example indices ``0 .. len(labels)-1`` among ``n_clients``.

    Args:
        labels: int [M] class indices (``dirichlet``), or any array of M rows (``iid``).
        n_clients: >= 1.
        scheme: ``iid`` or ``dirichlet:ALPHA`` (:func:`parse_partition`).
        seed: the split's seed.
        min_examples: every client gets at least this many examples.

    Returns:
        ``n_clients`` sorted int64 index arrays, disjoint, covering every example.

    Raises:
        ConfigError: a bad scheme or client count, fewer than ``n_clients * min_examples``
            examples, or no Dirichlet draw within :data:`MAX_DRAWS` gives every client
            ``min_examples`` (fewer clients or a larger ALPHA).
    """
    kind, alpha = parse_partition(scheme)
    labels = np.asarray(labels)
    m = len(labels)
    if int(n_clients) != n_clients or n_clients < 1:
        raise ConfigError(f"--clients must be a positive integer, got {n_clients}")
    if m < n_clients * min_examples:
        raise ConfigError(
            f"{m} training examples cannot give {n_clients} clients {min_examples} each: use "
            "fewer --clients"
        )
    rng = np.random.default_rng(seed)
    if kind == "iid":
        return [np.sort(part) for part in np.array_split(rng.permutation(m), n_clients)]
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ConfigError("--partition dirichlet needs class labels: use --partition iid")
    by_class = [rng.permutation(np.flatnonzero(labels == k)) for k in np.unique(labels)]
    for _ in range(MAX_DRAWS):
        parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
        for index in by_class:
            shares = rng.dirichlet(np.full(n_clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(index)).astype(int)
            for client, piece in enumerate(np.split(index, cuts)):
                parts[client].append(piece)
        out = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(p) for p in out) >= min_examples:
            return out
    raise ConfigError(
        f"no dirichlet:{alpha:g} split of {m} examples gives each of {n_clients} clients "
        f"{min_examples} examples: use fewer --clients or a larger ALPHA"
    )
