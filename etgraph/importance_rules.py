"""The first-order importance of a tensor and the update that defines it (paper §3.1 Eq. 2, §4).

The importance of tensor ``k`` is the first-order Taylor estimate of how much one update of its
weights reduces the training loss::

    I_k = -sum_i g_i * delta_w_i        (g = dL/dw at the current weights, i over tensor k)

``L(w + delta_w) ~= L(w) + sum_i g_i delta_w_i`` (paper Eq. 5), so ``I_k`` is the loss drop
attributed to tensor ``k``; the terms are additive over tensors, which is what lets the DP of
Eq. (3) sum importances of a selection. (The paper writes Eq. 2 without the minus sign and takes
its negative when selecting; here the sign is folded in so that larger = more useful.)

**Which update defines delta_w** (``variant``, :data:`IMPORTANCE_VARIANTS`; the run's
``TrainConfig.importance``). The runtime trains with ORT's AdamW (onnxruntime-training 1.19.2
runs only AdamW and momentum-less SGD; Hugging Face mode, ``adam_mode=1``): at step ``t`` (the
run's global step count + 1; ORT keeps one optimizer group) with the probe gradient ``g``::

    m' = b1 m + (1 - b1) g,   v' = b2 v + (1 - b2) g^2
    w1 = w - lr * sqrt(1 - b2^t) / (1 - b1^t) * m' / (sqrt(v') + eps),   w2 = w1 - lr * wd * w1

* ``"adam"`` (default) — delta_w = ``w2 - w``, the step the run's optimizer takes next
  (:func:`adamw_step`): a tensor that trained in the last period with the moments ``m, v`` the
  run carries (:class:`etgraph.checkpoint.CarriedState`); a tensor that did not with zero
  moments at the run's step count — exactly what the loop starts a newly selected tensor
  from. At the first period (no moments, ``t = 1``) this is ``"first-step"``. A tensor whose
  momentum disagrees with the probe gradient scores low or negative; one whose gradient is
  noisy scores by its signal-to-noise ratio (``|m| / sqrt(v)``), not by its size alone. It
  predicts each tensor's one-step loss drop on the probe batch within 1% (median) and ranks
  the tensors by their drop on another batch best of the variants (issue 30's
  ``benchmarks/importance_proxy.py``, docs/results.md "Quality ablation").
* ``"first-step"`` — AdamW's first step from zero moments at ``t = 1`` for every
  tensor (the rule before issue 30), ``delta_w = -lr * (g / (|g| + eps_eff) + weight_decay *
  w)`` with ``eps_eff = eps / sqrt(1 - b2)`` ~= 3.2e-5, hence ``I_k ~= lr * ||g_k||_1``: every
  weight moves by ``lr`` whatever the run has learned about its gradient, so the score grows
  with the tensor's size. It over-scores the tensors that trained more than the others (4.9x
  vs 2.0x their one-step loss drop on MobileNetV2).
* ``"grad-sq"`` — an SGD step, ``delta_w = -lr * (g + weight_decay * w)``, ``I_k ~= lr *
  ||g_k||^2`` (the loss drop of an optimizer the run does not train with; a baseline).
* ``"random"`` — ``I_k`` uniform in (0, 1], drawn from the period's probe seed, no gradients
  computed: the DP then picks a random selection within the budget (an ablation baseline).

All variants use the run's base learning rate (it scales every ``I_k`` alike, so it does not
change the selection; the base rate keeps delta_w far above float32 rounding late in the
cosine schedule).

Pure arithmetic on arrays; :mod:`etgraph.importance` computes the gradients in ORT sessions
and scores every tensor with :func:`variant_importance`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .errors import ConfigError
from .selection import IMPORTANCE_VARIANTS

__all__ = [
    "ADAMW_BETAS",
    "ADAMW_EPS",
    "SCRATCH_CHUNK",
    "adamw_first_step",
    "adamw_step",
    "check_importance_variant",
    "tensor_importance",
    "variant_importance",
]


def tensor_importance(gradients: Sequence[np.ndarray], deltas: Sequence[np.ndarray]) -> np.ndarray:
    """First-order importance of each tensor, ``I_k = -sum_i g_i * delta_w_i`` (paper Eq. 2, §4).

    Args:
        gradients: per tensor ``k`` (forward order), ``dL/dw`` at the weights before the update,
            float array of the tensor's shape.
        deltas: per tensor ``k``, the weight update ``w_after - w_before``, same shapes.

    Returns:
        float64 [N]: importance per tensor (loss reduction, in loss units; larger = more useful).
        Additive: the importance of a selection is the sum over its tensors.

    Raises:
        ConfigError: the two sequences differ in length, or a pair differs in shape.
    """
    if len(gradients) != len(deltas):
        raise ConfigError(
            f"{len(gradients)} gradients but {len(deltas)} weight updates: pass one per tensor"
        )
    out = np.empty(len(gradients), dtype=np.float64)
    for k, (g, d) in enumerate(zip(gradients, deltas, strict=True)):
        g = np.asarray(g, dtype=np.float64)
        d = np.asarray(d, dtype=np.float64)
        if g.shape != d.shape:
            raise ConfigError(
                f"tensor {k}: gradient shape {g.shape} differs from update shape {d.shape}"
            )
        out[k] = -float(np.sum(g * d))
    return out


#: onnxblock.optim.AdamW defaults, as etgraph.artifacts generates the optimizer.
ADAMW_BETAS = (0.9, 0.999)
ADAMW_EPS = 1e-6


def adamw_first_step(
    gradient: np.ndarray,
    weight: np.ndarray,
    learning_rate: float,
    weight_decay: float,
    *,
    betas: tuple[float, float] = ADAMW_BETAS,
    eps: float = ADAMW_EPS,
) -> np.ndarray:
    """The update ORT's AdamW (onnxblock, Hugging Face mode) makes at step 1 from zero moments.

    With ``m = (1 - b1) g``, ``v = (1 - b2) g^2`` and eps added to ``sqrt(v)`` before bias
    correction: ``delta_w = -lr * (g / (|g| + eps / sqrt(1 - b2)) + weight_decay * w)``.

    Args:
        gradient, weight: float arrays of one shape (dL/dw and w before the update).
        learning_rate: > 0. weight_decay: decoupled weight decay, >= 0.

    Returns:
        float64 array of the same shape, ``w_after - w_before``.
    """
    g = np.asarray(gradient, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)
    eps_eff = eps / np.sqrt(1.0 - betas[1])
    return -learning_rate * (g / (np.abs(g) + eps_eff) + weight_decay * w)


def adamw_step(
    gradient: np.ndarray,
    weight: np.ndarray,
    learning_rate: float,
    weight_decay: float,
    *,
    moments: Mapping[str, np.ndarray] | None = None,
    step: int = 0,
    betas: tuple[float, float] = ADAMW_BETAS,
    eps: float = ADAMW_EPS,
) -> np.ndarray:
    """The update ORT's AdamW (onnxblock, Hugging Face mode) makes next, at step ``step + 1``.

    ``m' = b1 m + (1 - b1) g``, ``v' = b2 v + (1 - b2) g^2``, ``w1 = w - lr * sqrt(1 - b2^t) /
    (1 - b1^t) * m' / (sqrt(v') + eps)``, ``w2 = w1 - lr * weight_decay * w1`` with ``t = step
    + 1`` (ORT's ``AdamWOptimizer`` kernel, ``adam_mode=1``).

    Args:
        gradient, weight: float arrays of one shape (dL/dw and w before the update).
        learning_rate: > 0. weight_decay: decoupled weight decay, >= 0.
        moments: ``{"momentum0": m, "momentum1": v}`` (the tensor's shape), as ORT stores them
            (:class:`etgraph.checkpoint.CarriedState`); None = zero moments.
        step: AdamW steps taken so far (the optimizer group's step count), >= 0.

    Returns:
        float64 array of the same shape, ``w2 - w``. With no moments at ``step`` 0 this is
        :func:`adamw_first_step` (up to its ``lr^2 * weight_decay`` term).
    """
    g = np.asarray(gradient, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)
    b1, b2 = betas
    m = v = 0.0
    if moments is not None:
        m = np.asarray(moments["momentum0"], dtype=np.float64)
        v = np.asarray(moments["momentum1"], dtype=np.float64)
    m1 = b1 * m + (1.0 - b1) * g
    v1 = b2 * v + (1.0 - b2) * g * g
    t = step + 1
    lr_corrected = learning_rate * np.sqrt(1.0 - b2**t) / (1.0 - b1**t)
    w1 = w - lr_corrected * m1 / (np.sqrt(v1) + eps)
    return w1 - learning_rate * weight_decay * w1 - w


def check_importance_variant(variant: str) -> str:
    """``variant`` if it is one of :data:`IMPORTANCE_VARIANTS`.

    Raises:
        ConfigError: another name (the message lists the variants).
    """
    if variant not in IMPORTANCE_VARIANTS:
        raise ConfigError(
            f"unknown importance {variant!r}: choose one of {', '.join(IMPORTANCE_VARIANTS)}"
        )
    return variant


#: Elements per chunk in :func:`variant_importance` (4 MB float32 scratch buffers).
SCRATCH_CHUNK = 1 << 20


def variant_importance(
    variant: str,
    gradient: np.ndarray,
    weight: np.ndarray,
    learning_rate: float,
    weight_decay: float,
    batches: int,
    scratch: np.ndarray,
    moments: Mapping[str, np.ndarray] | None = None,
    step: int = 0,
) -> float:
    """:func:`tensor_importance` of one tensor under ``variant``'s delta_w (``"adam"``:
    :func:`adamw_step`, ``"first-step"``: :func:`adamw_first_step`, ``"grad-sq"``: an SGD step),
    without materialising the update.

    ``g`` is the accumulated gradient divided by ``batches``. Computed chunk-wise in float32
    with float64 accumulation in three preallocated buffers (``scratch``: float32
    [3, :data:`SCRATCH_CHUNK`]): whole-tensor float64 temporaries cost ~0.5 s per evaluation on
    ResNet50 once freed memory has been returned to the OS (page faults on every new array),
    ten times the arithmetic.

    Args:
        variant: ``"adam"``, ``"first-step"`` or ``"grad-sq"`` (``"random"`` has no gradients).
        gradient, weight: float arrays of one shape (the accumulated dL/dw, w before the update).
        learning_rate, weight_decay: of the update. batches: how many gradients were summed.
        scratch: float32 [3, >= :data:`SCRATCH_CHUNK`], overwritten.
        moments, step: ``"adam"``: as :func:`adamw_step` takes them.

    Returns:
        ``I_k`` in loss units (larger = more useful).
    """
    g = np.asarray(gradient, dtype=np.float32).reshape(-1)
    w = np.asarray(weight, dtype=np.float32).reshape(-1)
    m = v = None
    if variant == "adam" and moments is not None:
        m = np.asarray(moments["momentum0"], dtype=np.float32).reshape(-1)
        v = np.asarray(moments["momentum1"], dtype=np.float32).reshape(-1)
    b1, b2 = ADAMW_BETAS
    t_next = step + 1
    # -sum(g * delta_w) = lr * sum(g * (scale * direction + wd * w)), per variant
    scale = np.sqrt(1.0 - b2**t_next) / (1.0 - b1**t_next) * (1.0 - learning_rate * weight_decay)
    eps_eff = ADAMW_EPS / np.sqrt(1.0 - b2)
    total = 0.0
    for start in range(0, g.size, SCRATCH_CHUNK):
        gs, ws = g[start : start + SCRATCH_CHUNK], w[start : start + SCRATCH_CHUNK]
        n = gs.size
        gm, t, u = scratch[0, :n], scratch[1, :n], scratch[2, :n]
        np.multiply(gs, 1.0 / batches, out=gm)  # mean gradient over the probe batches
        if variant == "grad-sq":
            t[...] = gm
        elif variant == "first-step":
            np.abs(gm, out=t)
            t += eps_eff
            np.divide(gm, t, out=t)  # g / (|g| + eps_eff)
        else:  # adam: m' / (sqrt(v') + eps), scaled
            if v is None:
                u.fill(0.0)
            else:
                np.multiply(v[start : start + n], b2, out=u)
            np.multiply(gm, gm, out=t)
            t *= 1.0 - b2
            u += t  # v'
            np.sqrt(u, out=u)
            u += ADAMW_EPS
            np.multiply(gm, (1.0 - b1) / b1, out=t)
            if m is not None:
                t += m[start : start + n]
            t *= b1  # m'
            t /= u
            t *= scale
        np.multiply(ws, weight_decay, out=u)
        t += u
        t *= gm
        total += float(t.sum(dtype=np.float64))
    return float(learning_rate) * total
