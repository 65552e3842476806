"""FedEL's two failure modes of elastic federated training, and the switches that address
them (issue 29; FedEL, NeurIPS '25, arXiv 2509.16902).

(a) **The front is starved.** Under one shared deadline a slow client can only afford the
    tensors nearest the output: training tensor ``k`` costs the error-gradient chain
    ``t_dy[k:]`` back to it (paper Eq. 3), so the DP of a small budget never reaches the input
    end, and the early layers of the global model are trained by the fast clients alone.
    **Window** (:func:`window`): the server assigns each client a window of consecutive tensors
    that moves from the output towards the input round by round (clients offset from each
    other); a client whose budget is below 1 selects only inside it and the output layer
    (:func:`restrict`: the head is cheap and, in transfer learning, what matters most; the
    window is about what else to train), the window moved back towards the output as far as its
    budget needs (:func:`affordable_window`). A client that can train everything does.
(b) **Importance is local.** A client's importance comes from its own (non-IID) probe batch.
    **Global importance** (:func:`blend`): the server averages the importance vectors the
    clients report (each normalised, weighted by examples) and sends it back; a client selects
    on ``(1 - beta) * local + beta * global`` (both normalised).

Pure numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["affordable_window", "blend", "normalised", "restrict", "window"]


def normalised(importance: Sequence[float]) -> np.ndarray:
    """float64 [N]: the positive part of ``importance`` over its sum (zeros if none)."""
    v = np.clip(np.asarray(importance, dtype=np.float64), 0.0, None)
    total = v.sum()
    return v / total if total > 0 else v


def blend(local: np.ndarray, global_: Sequence[float] | None, beta: float) -> np.ndarray:
    """``(1 - beta) * normalised(local) + beta * normalised(global_)``, scaled back to the
    local vector's positive sum (the DP's values keep their magnitude). ``global_`` None or
    of another length: the local importance as is."""
    local = np.asarray(local, dtype=np.float64)
    if global_ is None or len(global_) != local.size or beta <= 0:
        return local
    scale = float(np.clip(local, 0.0, None).sum()) or 1.0
    return scale * ((1.0 - beta) * normalised(local) + beta * normalised(global_))


def window(n: int, fraction: float, server_round: int, ordinal: int) -> tuple[int, int]:
    """``[start, end)`` of the tensors (forward order) client ``ordinal`` may train in round
    ``server_round`` (1-based): ``ceil(fraction * n)`` consecutive tensors; the window's end
    steps back by half a window per round from the output end, wrapping round, clients offset
    by one step each."""
    width = min(n, max(1, math.ceil(fraction * n)))
    stride = max(1, width // 2)
    positions = max(1, math.ceil((n - width) / stride) + 1)
    j = (server_round - 1 + ordinal) % positions
    end = max(width, n - j * stride)
    return end - width, end


def affordable_window(
    bounds: tuple[int, int], rho: float, single_rho: Sequence[float]
) -> tuple[int, int]:
    """``bounds`` moved towards the output until training its last tensor alone costs at most
    ``rho`` (``single_rho[k]``: the step-time ratio of training tensor ``k`` alone); as far as
    the output end."""
    start, end = bounds
    n = len(single_rho)
    while end < n and single_rho[end - 1] > rho:
        start, end = start + 1, end + 1
    return start, end


def restrict(
    importance: np.ndarray, bounds: tuple[int, int], keep: Sequence[int] = ()
) -> np.ndarray:
    """Importance with every tensor outside ``[start, end)`` and ``keep`` (indices, e.g. the
    output layer's) made so negative that any selection of allowed tensors beats any selection
    with another (the DP of Eq. 3 then selects among the allowed ones whenever one fits the
    budget)."""
    imp = np.asarray(importance, dtype=np.float64).copy()
    start, end = bounds
    outside = np.ones(imp.size, dtype=bool)
    outside[start:end] = False
    outside[list(keep)] = False
    imp[outside] = -(np.abs(imp).sum() + 1.0)
    return imp
