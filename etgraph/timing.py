"""Time model of selective training (paper §2.2 and Eq. 3, with the inclusive f(M)).

All arrays are in forward execution order: index 0 is the tensor nearest the model input, index
N-1 the one nearest the output. Timings are wall-clock microseconds (float or int, >= 0).

For a selection mask ``M`` (bool [N]) let ``e(M)`` be the index of the earliest selected tensor.
Training the selected tensors costs

    backward_us(M) = sum_k M[k] * t_dw_us[k]  +  sum_{k >= e(M)} t_dy_us[k]

i.e. every selected tensor pays its own weight-gradient time ``t_dw`` and the error gradient must
be propagated from the output down to (and including) the earliest selected tensor — the paper's
``f(M)``: M = [0,0,0,1,1,0,0] gives f(M) = [0,0,0,1,1,1,1]. An empty mask has no backward pass
(0 µs). One training step costs ``step_us(M) = forward_us + backward_us(M)``; full training is the
all-ones mask. The DP in :mod:`etgraph.selection` optimises against exactly this chain cost.

**Branches.** The chain rule is exact when every backward op's D(o) (the tensors whose gradient
needs it) is a prefix {0..k}. On parallel branches (a ResNet block's main branch beside its
projection shortcut) an op's D is {0..p-1} plus its own branch's tensors, and the op runs only
if the earliest selected tensor is before the branch point (``e < p``) or a tensor of its
branch is selected. The chain counts it whenever ``e <= k`` (an over-estimate when ``e`` falls
on the other branch). Passing the profile's :class:`BranchCharges` makes :func:`backward_us` count
those ops exactly; the DP keeps the chain cost, an upper bound of the exact one, so its
selections always respect the budget.

**Closed loop.** The profile is measured once, under profiling; the run then measures thousands
of steps. :func:`fit_step_times` fits ``measured ≈ scale * (step_us(M) + offset_us)`` to the
elastic steps and the full-step references the loop measured alike (:mod:`etgraph.loop`), and
:meth:`StepTimeFit.time_model` gives the DP the corrected model, whose budget
``rho * T_full'`` then asks for ``rho`` of the *measured* full step.

Pure numpy: no ONNX Runtime or torch import here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from etgraph.errors import ConfigError

__all__ = [
    "BranchCharges",
    "earliest_selected",
    "backward_us",
    "backward_us_many",
    "step_us",
    "budget_us",
    "single_tensor_costs_us",
    "min_feasible_backward_us",
    "min_feasible_rho",
    "MAX_OFFSET_FRACTION",
    "StepTimeFit",
    "TimeModel",
    "fit_step_times",
]


def _timings(t_dw_us, t_dy_us) -> tuple[np.ndarray, np.ndarray]:
    """Validate and return (t_dw_us, t_dy_us) as float64 arrays of equal shape [N]."""
    t_dw = np.asarray(t_dw_us, dtype=np.float64)
    t_dy = np.asarray(t_dy_us, dtype=np.float64)
    if t_dw.ndim != 1 or t_dw.shape != t_dy.shape:
        raise ConfigError(
            f"t_dw_us and t_dy_us must be 1-D arrays of the same length, got shapes "
            f"{t_dw.shape} and {t_dy.shape}; pass one timing per trainable tensor"
        )
    if not (np.all(np.isfinite(t_dw)) and np.all(np.isfinite(t_dy))):
        raise ConfigError("t_dw_us/t_dy_us contain NaN or inf; re-run the profiler")
    if np.any(t_dw < 0) or np.any(t_dy < 0):
        raise ConfigError("t_dw_us/t_dy_us contain negative times; re-run the profiler")
    return t_dw, t_dy


def _mask(mask, n: int) -> np.ndarray:
    m = np.asarray(mask)
    if m.shape != (n,):
        raise ConfigError(f"selection mask has shape {m.shape}, expected ({n},) (one per tensor)")
    return m.astype(bool, copy=False)


@dataclass(frozen=True)
class BranchCharges:
    """``t_dy`` work of backward ops on parallel branches (D(o) not a prefix), G groups.

    Attributes:
        tensor: int [G], index of the tensor whose ``t_dy_us`` holds the work (the chain counts
            it iff ``e(M) <= tensor``).
        prefix: int [G], ``p``: D(o) contains every tensor before ``p``.
        extra: bool [G, N], the other tensors of D(o) (the op's own branch).
        us: float [G] µs, the work (already included in ``t_dy_us[tensor]``).

    Exactly, group g runs iff ``e(M) < prefix[g]`` or ``M & extra[g]`` is not empty.
    """

    tensor: np.ndarray
    prefix: np.ndarray
    extra: np.ndarray
    us: np.ndarray

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping], n: int) -> BranchCharges:
        """From ``[{"tensor", "prefix", "extra": [indices], "us"}]`` (a profile's ``branches``).

        Raises:
            ConfigError: an index is outside [0, n) or a time is negative / not finite.
        """
        rows = list(rows)
        extra = np.zeros((len(rows), n), dtype=bool)
        try:
            for g, r in enumerate(rows):
                extra[g, np.asarray(r["extra"], dtype=np.int64)] = True
            tensor = np.array([int(r["tensor"]) for r in rows], dtype=np.int64)
            prefix = np.array([int(r["prefix"]) for r in rows], dtype=np.int64)
            us = np.array([float(r["us"]) for r in rows], dtype=np.float64)
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed branch charges ({exc}): re-run the profiler") from exc
        if np.any((tensor < 0) | (tensor >= n)) or not np.all(np.isfinite(us)) or np.any(us < 0):
            raise ConfigError("branch charges have bad tensor indices or times: re-profile")
        return cls(tensor, prefix, extra, us)

    def correction_us(self, masks: np.ndarray, first: np.ndarray) -> np.ndarray:
        """Exact minus chain-counted branch work (µs, <= 0 when the chain over-counts), [K].

        Args:
            masks: bool [K, N]. first: int [K], ``e(M)`` per row (N for an empty row).
        """
        if self.us.size == 0:
            return np.zeros(len(masks))
        first = first[:, None]
        counted = first <= self.tensor[None, :]
        runs = (first < self.prefix[None, :]) | ((masks.astype(np.float64) @ self.extra.T) > 0)
        return (runs.astype(np.float64) - counted) @ self.us


def earliest_selected(mask) -> int | None:
    """Index of the earliest (nearest the input) selected tensor, ``e(M)``; None for an empty mask.

    Args:
        mask: selection mask, bool (or 0/1) array [N], forward order.
    """
    idx = np.flatnonzero(np.asarray(mask, dtype=bool))
    return int(idx[0]) if idx.size else None


def backward_us(mask, t_dw_us, t_dy_us, branches: BranchCharges | None = None) -> float:
    """Predicted backward time (µs) of training the tensors in ``mask`` (paper Eq. 3).

    ``sum(M * t_dw_us) + sum(t_dy_us[e(M):])``; 0.0 for an empty mask. With ``branches``, the
    branch work inside ``t_dy_us`` is counted only where it runs (module docstring).

    Args:
        mask: selection mask, bool [N], forward order.
        t_dw_us, t_dy_us: float [N] µs, >= 0, forward order.
        branches: the profile's branch charges, or None for the plain chain model.
    Raises:
        ConfigError: shapes disagree, or timings are negative / not finite.
    """
    m = _mask(mask, np.asarray(t_dw_us).size)
    return float(backward_us_many(m[None, :], t_dw_us, t_dy_us, branches)[0])


def backward_us_many(masks, t_dw_us, t_dy_us, branches: BranchCharges | None = None) -> np.ndarray:
    """Vectorised :func:`backward_us` for K masks at once.

    Args:
        masks: bool [K, N], one selection mask per row, forward order.
        t_dw_us, t_dy_us: float [N] µs.
        branches: as in :func:`backward_us`.
    Returns:
        float64 [K] µs; 0.0 for empty rows.
    """
    t_dw, t_dy = _timings(t_dw_us, t_dy_us)
    m = np.asarray(masks, dtype=bool)
    if m.ndim != 2 or m.shape[1] != t_dw.size:
        raise ConfigError(f"masks has shape {m.shape}, expected (K, {t_dw.size})")
    # suffix[k] = sum(t_dy[k:]), with suffix[N] = 0 for empty rows.
    suffix = np.concatenate([np.cumsum(t_dy[::-1])[::-1], [0.0]])
    any_sel = m.any(axis=1)
    first = np.where(any_sel, m.argmax(axis=1), t_dw.size)
    out = m @ t_dw + suffix[first]
    if branches is not None:
        out = out + branches.correction_us(m, first)
    return out


def step_us(
    mask, t_dw_us, t_dy_us, forward_us: float, branches: BranchCharges | None = None
) -> float:
    """Predicted time (µs) of one training step: ``forward_us + backward_us(mask, ...)``."""
    return float(forward_us) + backward_us(mask, t_dw_us, t_dy_us, branches)


def budget_us(rho: float, forward_us: float, t_full_us: float) -> float:
    """Backward-pass budget (µs) for speedup objective ``rho``: ``rho * t_full_us - forward_us``.

    Paper Eq. 3: T_selective <= rho * T_full, with T_selective = forward + backward(M) and
    ``t_full_us`` = T_full, the time model's full step (``Profile.t_full_us``).
    The result may be negative (rho below what the forward pass alone costs); the selector
    then raises :class:`~etgraph.errors.InfeasibleBudgetError`.

    Raises:
        ConfigError: ``rho`` not in (0, 1], or ``t_full_us`` not positive.
    """
    rho = float(rho)
    if not (0.0 < rho <= 1.0):
        raise ConfigError(f"rho must be in (0, 1] (fraction of the full step time), got {rho}")
    if not float(t_full_us) > 0.0:
        raise ConfigError(f"t_full_us must be positive, got {t_full_us}")
    return rho * float(t_full_us) - float(forward_us)


def single_tensor_costs_us(t_dw_us, t_dy_us) -> np.ndarray:
    """Backward time (µs) of training each tensor k alone, float [N].

    ``t_dw_us[k] + sum(t_dy_us[k:])`` (the inclusive f(M) of a one-tensor mask).
    """
    t_dw, t_dy = _timings(t_dw_us, t_dy_us)
    return t_dw + np.cumsum(t_dy[::-1])[::-1]


def min_feasible_backward_us(t_dw_us, t_dy_us) -> tuple[float, int]:
    """Smallest backward budget (µs) at which some tensor can be trained, and that tensor's index.

    Raises:
        ConfigError: no tensors (N = 0) or invalid timings.
    """
    costs = single_tensor_costs_us(t_dw_us, t_dy_us)
    if costs.size == 0:
        raise ConfigError("no trainable tensors: the model has nothing to select")
    k = int(np.argmin(costs))
    return float(costs[k]), k


def min_feasible_rho(t_dw_us, t_dy_us, forward_us: float, t_full_us: float) -> float:
    """Smallest ``rho`` at which at least one tensor can be selected.

    ``(forward_us + min_k (t_dw_us[k] + sum(t_dy_us[k:]))) / t_full_us`` (``t_full_us`` = T_full,
    µs). A value > 1 means the timings are inconsistent with ``t_full_us`` (no rho in (0, 1] is
    feasible).

    Raises:
        ConfigError: ``t_full_us`` not positive, no tensors, or invalid timings.
    """
    if not float(t_full_us) > 0.0:
        raise ConfigError(f"t_full_us must be positive, got {t_full_us}")
    cheapest_us, _ = min_feasible_backward_us(t_dw_us, t_dy_us)
    return (float(forward_us) + cheapest_us) / float(t_full_us)


@dataclass(frozen=True)
class TimeModel:
    """What the selectors read of a time model (duck-typed like a Profile): ``t_dw_us``,
    ``t_dy_us`` (float [N] µs, forward order), ``forward_us`` and ``t_full_us`` (µs)."""

    t_dw_us: np.ndarray
    t_dy_us: np.ndarray
    forward_us: float
    t_full_us: float


@dataclass(frozen=True)
class StepTimeFit:
    """The time model corrected by measured steps: ``measured_us ≈ scale * (step_us(M) +
    offset_us)`` for every selection M, the full step included.

    ``offset_us`` (model µs) is the per-step time the model misses or over-counts (executor,
    session and Python overheads, the profile's per-node profiling overhead); it alone decides
    the *ratio* of two steps, so it is what the DP needs. ``scale`` (dimensionless) is how fast
    the machine runs now against the profile (load, spinning); it changes absolute predictions
    only. ``fixed_us = scale * offset_us`` is the measured µs per step outside the model.

    Attributes:
        scale: > 0. offset_us: µs of the model's units (may be negative).
        observations: how many (elastic, reference) pairs the fit used (0 = identity).
    """

    scale: float = 1.0
    offset_us: float = 0.0
    observations: int = 0

    @property
    def fixed_us(self) -> float:
        """Measured µs per step outside the model, ``scale * offset_us``."""
        return self.scale * self.offset_us

    def predict_us(self, model_step_us: float) -> float:
        """Predicted measured step (µs) of a selection whose model step is ``model_step_us``."""
        return self.scale * (float(model_step_us) + self.offset_us)

    def rho(self, model_step_us: float, t_full_us: float) -> float:
        """Predicted measured step ratio ``(step + offset) / (T_full + offset)``."""
        return (float(model_step_us) + self.offset_us) / (float(t_full_us) + self.offset_us)

    def time_model(self, t_dw_us, t_dy_us, forward_us: float, rho: float) -> TimeModel:
        """The corrected time model the DP budgets ``rho`` with: ``offset_us`` added to the
        forward (every step pays it) and to ``T_full``.

        The offset is clamped so that the corrected model stays meaningful at ``rho``: at least
        ``-forward_us`` (no negative constant), and, for ``rho < 1``, at most what still lets
        the cheapest tensor fit the budget (a fit from noisy steps must not make a feasible run
        infeasible mid-way).

        Args:
            t_dw_us, t_dy_us: float [N] µs, forward order (the profile's).
            forward_us: the profile's constant step time, µs. rho: requested ratio in (0, 1].

        Raises:
            ConfigError: invalid timings, or ``rho`` not in (0, 1].
        """
        t_dw, t_dy = _timings(t_dw_us, t_dy_us)
        if not (0.0 < float(rho) <= 1.0):
            raise ConfigError(f"rho must be in (0, 1], got {rho}")
        t_full = float(forward_us + t_dw.sum() + t_dy.sum())
        offset = max(self.offset_us, -float(forward_us))
        if rho < 1.0:
            cheapest, _ = min_feasible_backward_us(t_dw, t_dy)
            # 1 ns short of the bound: at the bound, rounding can leave the budget one ulp
            # below the cheapest tensor (seen: "budget 12.2 us is below ... 12.2 us")
            bound = (rho * t_full - forward_us - cheapest) / (1.0 - rho) - 1e-3
            offset = min(offset, bound)
        return TimeModel(t_dw, t_dy, float(forward_us) + offset, t_full + offset)


#: The open loop's vote in :func:`fit_step_times` is dropped when every measured epoch puts
#: the open loop's ratio off by more than this (fraction), in the same direction.
PRIOR_DROP_ERROR = 0.10

#: The largest fixed cost per step outside the model :func:`fit_step_times` infers, as a
#: fraction of ``T_full``. The 394 fits replayed from the logged closed-loop runs (paper models
#: and the default one, quiet and under a CPU hog; ``benchmarks/results/closed_loop*.json``)
#: lie in -0.41 ... +0.24; one epoch measured at load 10-17 by CPU time (issue 30's vision
#: seed 0) gave +1.44, under which rho 0.5 left the next period the head's bias alone.
MAX_OFFSET_FRACTION = 0.5


def fit_step_times(
    model_step_us, measured_us, reference_us, t_full_us: float, *, prior_vote: bool = True
) -> StepTimeFit:
    """Fit :class:`StepTimeFit` to steps measured in the training loop.

    Observation i is one stretch of training (an epoch): a selection whose model step is
    ``model_step_us[i]`` measured at ``measured_us[i]``, and full steps measured alike
    (interleaved with it, same batches, same clock) at ``reference_us[i]``; ``t_full_us`` is
    the model's full step. With ``m = s (p + c)`` and ``r = s (T + c)`` the load factor ``s``
    cancels in ``m (T + c) = r (p + c)``, linear in the offset ``c``: each observation gives
    one, ``c_i = (r p - m T) / (m - r)``, and the fit is their median over all observations
    together with the open loop's ``c = 0`` as one more (the machine's overhead per step is the
    machine's, whatever its load; the median ignores an epoch a burst of other work spoiled,
    and the open loop's vote halves a correction only one epoch supports), and ``s`` from the
    latest observation alone (the load now). The open loop's vote is left out when every
    observation says, in the same direction, that the open loop's ratio is off by more than
    :data:`PRIOR_DROP_ERROR` (more than the per-epoch noise: a profile measured under other
    conditions; going half way then missed rho by 16-21% in the second period on ResNet50 and
    MobileNetV2). Observations whose elastic and full steps differ by less than 2% carry no
    information on ``c`` and are left out of its fit. ``c`` is kept within ``-0.9 T`` (so
    ``T + c > 0``) and :data:`MAX_OFFSET_FRACTION` ``* T``: a larger fixed cost per step is a
    load artefact, not the machine's overhead.

    Args:
        model_step_us, measured_us, reference_us: float [K] µs (K >= 0; NaN rows are ignored).
        t_full_us: the model's ``T_full`` µs (> 0).
        prior_vote: whether the open loop's ``c = 0`` votes (the loop's rule); False only to
            compare rules (``benchmarks/fit_replay.py``).

    Returns:
        The fit; the identity (scale 1, offset 0, 0 observations) when no row is usable.
    """
    p = np.asarray(model_step_us, dtype=np.float64)
    m = np.asarray(measured_us, dtype=np.float64)
    r = np.asarray(reference_us, dtype=np.float64)
    ok = np.isfinite(p) & np.isfinite(m) & np.isfinite(r) & (m > 0) & (r > 0)
    p, m, r = p[ok], m[ok], r[ok]
    if p.size == 0 or not float(t_full_us) > 0:
        return StepTimeFit()
    t_full = float(t_full_us)
    d = m - r
    informative = np.abs(d) > 0.02 * r
    offset = 0.0
    if informative.any():
        per_epoch = ((r * p - m * t_full) / np.where(informative, d, 1.0))[informative]
        pi = p[informative]
        # how far each epoch says the open loop's ratio p / T is off: (p + c) / (T + c) / (p / T)
        off = (pi + per_epoch) * t_full / ((t_full + per_epoch) * pi) - 1.0
        agree = bool(np.all(off > PRIOR_DROP_ERROR) or np.all(off < -PRIOR_DROP_ERROR))
        vote = prior_vote and not agree
        offset = float(np.median(np.append(per_epoch, 0.0) if vote else per_epoch))
    offset = min(max(offset, -0.9 * t_full), MAX_OFFSET_FRACTION * t_full)  # T_full + c > 0
    scale = float(r[-1] / (t_full + offset))
    return StepTimeFit(scale, offset, int(p.size))
