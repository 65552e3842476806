"""Tensor selection under a backward-time budget (paper §3.3 Eq. 3 and §6).

Problem (paper Eq. 3, with the time model of :mod:`etgraph.timing`): over the N trainable tensors
(forward execution order, index 0 nearest the input), choose a NON-EMPTY selection mask ``M``
maximising ``sum(M * importance)`` subject to

    backward_us(M) = sum(M * t_dw_us) + sum(t_dy_us[e(M):])  <=  budget_us,

where ``e(M)`` is the earliest selected tensor and ``budget_us = rho * t_full_us - forward_us``
(:func:`etgraph.timing.budget_us`; ``t_full_us`` is the time model's full step T_full).

Solvers (same signature, all return a :class:`Selection`):

* :func:`select_tensors` — the shipped DP, exact, O(N*T) time and O(T) memory for values plus
  bit-packed back-pointers (T = budget in integer time units). The ``t_dy`` term depends only on
  the earliest selected tensor ``e``: sweeping ``e`` from the output towards the input while
  maintaining a 0/1-knapsack table over the tensors after ``e`` (weights ``t_dw``, values
  ``importance``) gives ``value(e) = importance[e] + F_{e+1}[B - sum(t_dy[e:]) - t_dw[e]]``.
* :func:`select_tensors` with ``memory=`` (:class:`MemoryCosts`, issue #17) — the same DP under a
  peak-memory budget as well. The memory model (:mod:`etgraph.memory`) is
  ``peak(M) = max(floor, base + sum(M * tensor_mb) + earliest_mb[e(M)])``: like the ``t_dy``
  term of Eq. (3), its non-additive part depends only on the earliest selected tensor ``e``
  (how far back the gradient travels, so how many activations the backward pass keeps alive).
  Fixing ``e`` therefore turns both constraints into 0/1-knapsack constraints over the tensors
  after ``e``: the sweep keeps a 2-D table ``F[t, m]`` (time units x memory units) and
  ``value(e) = importance[e] + F[cap_t(e), cap_m(e)]`` with
  ``cap_m(e) = budget_mb - base_mb - earliest_mb[e] - tensor_mb[e]``. O(N*T*R) for R memory
  units; exact for integer costs.
* :func:`select_naive_dp` — the paper's O(N^2*T) recurrence (§6.2, Eq. 4) transcribed directly;
  the oracle and baseline of ``benchmarks/dp.py`` and the tests.
* :func:`select_topk` and :func:`select_backward_prefix` — comparison baselines under the same
  budget and the same time model.

Strategies (what ``etgraph train --strategy`` and ``compile`` run):

* :func:`select_for_rho` — THE "budget, then select" step: the budget of a step-time ratio
  ``rho`` from a profile, then the budgeted strategy (``elastic`` = the DP, ``topk``, ``prefix``).
* :func:`strategy_mask` — the mask of any strategy in :data:`STRATEGIES` (the budget-free
  ``full``, ``last-layer``, ``bn-bias``, ``bias-only`` and, through :func:`select_for_rho`,
  the budgeted ones).

Pure numpy: no ONNX Runtime or torch import here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from etgraph import timing
from etgraph.dp import (
    MAX_TABLE_UNITS,
    best_single,
    discretise,
    dp_sweep,
    dp_sweep_2d,
    naive_recurrence,
    solve_within_budget,
)
from etgraph.errors import ConfigError, InfeasibleBudgetError, InfeasibleMemoryError
from etgraph.timing import (
    _timings,
    backward_us,
    min_feasible_backward_us,
    single_tensor_costs_us,
)

__all__ = [
    "MemoryCosts",
    "check_memory_floor",
    "Selection",
    "select_tensors",
    "select_naive_dp",
    "select_topk",
    "select_backward_prefix",
    "select_for_rho",
    "MAX_TABLE_UNITS",
    "STRATEGIES",
    "BUDGETED_STRATEGIES",
    "IMPORTANCE_STRATEGIES",
    "IMPORTANCE_VARIANTS",
    "strategy_mask",
]

log = logging.getLogger(__name__)

#: Selection strategies of the runtime: the DP (``elastic``) and the baselines. ``prefix`` is the
#: longest prefix of the backward pass that fits (:func:`select_backward_prefix`).
STRATEGIES = ("elastic", "full", "last-layer", "bn-bias", "bias-only", "prefix", "topk")
#: Strategies that select under the budget of ``rho`` (:func:`select_for_rho`).
BUDGETED_STRATEGIES = ("elastic", "topk", "prefix")
#: Strategies whose selection needs fresh importance every period.
IMPORTANCE_STRATEGIES = frozenset({"elastic", "topk"})
#: How the importance those strategies select by defines delta_w (:mod:`etgraph.importance`):
#: the optimizer's next step (the default), AdamW's first step from zero moments, an SGD step,
#: or no gradients at all (random importance, an ablation baseline).
IMPORTANCE_VARIANTS = ("adam", "first-step", "grad-sq", "random")


@dataclass(frozen=True, eq=False)
class Selection:
    """Result of a tensor selector.

    Attributes:
        mask: selection mask, read-only bool ndarray [N], forward order (True = train the tensor).
        objective: ``sum(importance[mask])`` (float).
        backward_us: predicted backward time of ``mask`` in real µs
            (:func:`etgraph.timing.backward_us`), always ``<= budget_us`` it was solved for.
        strategy: which selector produced it: ``"dp"``, ``"naive_dp"``, ``"topk"`` or ``"prefix"``.
    """

    mask: np.ndarray
    objective: float
    backward_us: float
    strategy: str

    @property
    def indices(self) -> np.ndarray:
        """Indices (int64, ascending = forward order) of the selected tensors."""
        return np.flatnonzero(self.mask)

    @property
    def count(self) -> int:
        """Number of selected tensors."""
        return int(self.mask.sum())


@dataclass(frozen=True, eq=False)
class MemoryCosts:
    """The memory side of the selection problem (issue #17), MiB; see :mod:`etgraph.memory`.

    ``peak(M) = max(floor_mb, base_mb + sum(M * tensor_mb) + earliest_mb[e(M)])`` must stay
    ``<= budget_mb``.

    Attributes:
        tensor_mb: float [N] >= 0, forward order: what selecting tensor k adds.
        earliest_mb: float [N] >= 0: what the step adds when tensor e is the earliest selected.
        budget_mb: the peak-memory budget (``--memory-mb``).
        base_mb: paid by every selection. floor_mb: a floor of every peak (start-up).
        resolution_mb: the DP's memory unit (> 0). Costs are rounded to the nearest unit and
            the budget down; a solution whose real peak exceeds the budget is re-solved with a
            budget one excess smaller, so the result never exceeds ``budget_mb`` in real MiB.
    """

    tensor_mb: np.ndarray
    earliest_mb: np.ndarray
    budget_mb: float
    base_mb: float = 0.0
    floor_mb: float = 0.0
    resolution_mb: float = 1.0

    @classmethod
    def from_profile(cls, memory_profile, budget_mb: float, *, resolution_mb: float = 1.0):
        """From an :class:`etgraph.memory.MemoryProfile` and a budget (MiB)."""
        return cls(
            tensor_mb=memory_profile.tensor_mb,
            earliest_mb=memory_profile.earliest_mb,
            budget_mb=float(budget_mb),
            base_mb=memory_profile.base_mb,
            floor_mb=memory_profile.load_mb,
            resolution_mb=resolution_mb,
        )

    def checked(self, n: int) -> MemoryCosts:
        """Self with float64 arrays, validated for N tensors; raises ConfigError otherwise."""
        tensor_mb = np.asarray(self.tensor_mb, dtype=np.float64)
        earliest_mb = np.asarray(self.earliest_mb, dtype=np.float64)
        if tensor_mb.shape != (n,) or earliest_mb.shape != (n,):
            raise ConfigError(f"memory costs must have one entry per tensor ({n})")
        values = np.concatenate([tensor_mb, earliest_mb, [self.base_mb, self.floor_mb]])
        if not np.all(np.isfinite(values)) or np.any(values < 0):
            raise ConfigError("memory costs contain negative or non-finite values: re-measure")
        if not (self.resolution_mb > 0 and math.isfinite(self.resolution_mb)):
            raise ConfigError(f"memory resolution must be positive, got {self.resolution_mb}")
        if math.isnan(float(self.budget_mb)):
            raise ConfigError("memory budget is NaN")
        return MemoryCosts(
            tensor_mb,
            earliest_mb,
            float(self.budget_mb),
            float(self.base_mb),
            float(self.floor_mb),
            float(self.resolution_mb),
        )

    def peak_mb(self, mask) -> float:
        """Predicted peak (MiB) of a non-empty ``mask`` (bool [N])."""
        m = np.asarray(mask, dtype=bool)
        e = int(np.argmax(m))
        steady = self.base_mb + float(self.tensor_mb[m].sum()) + float(self.earliest_mb[e])
        return max(self.floor_mb, steady)

    def single_peaks_mb(self) -> np.ndarray:
        """Peak (MiB) of training each tensor alone, float [N]."""
        return np.maximum(self.floor_mb, self.base_mb + self.tensor_mb + self.earliest_mb)


# --------------------------------------------------------------------------------------------
# Shared plumbing: validation, the result type, infeasibility.


def _inputs(t_dw_us, t_dy_us, importance, budget_us):
    t_dw, t_dy = _timings(t_dw_us, t_dy_us)
    imp = np.asarray(importance, dtype=np.float64)
    if imp.shape != t_dw.shape:
        raise ConfigError(
            f"importance has shape {imp.shape} but the timings have {t_dw.shape}; "
            "pass one importance per trainable tensor"
        )
    if not np.all(np.isfinite(imp)):
        raise ConfigError(
            "importance contains NaN or inf (the probe batches' gradients were not finite): "
            "check the data for NaN or extreme values, or lower the learning rate"
        )
    if t_dw.size == 0:
        raise ConfigError("no trainable tensors: the model has nothing to select")
    budget = float(budget_us)
    if math.isnan(budget):
        raise ConfigError("budget_us is NaN")
    return t_dw, t_dy, imp, budget


def _result(mask, imp, t_dw, t_dy, strategy) -> Selection:
    mask = np.asarray(mask, dtype=bool).copy()
    mask.setflags(write=False)
    return Selection(
        mask=mask,
        objective=float(imp[mask].sum()),
        backward_us=backward_us(mask, t_dw, t_dy),
        strategy=strategy,
    )


def check_memory_floor(memory: MemoryCosts) -> None:
    """Raise InfeasibleMemoryError when ``memory.budget_mb`` is below the peak of training any
    one tensor alone, whatever the time budget: before a run measures anything else.

    Raises:
        InfeasibleMemoryError: names the smallest feasible ``--memory-mb`` (whole MiB).
    """
    zeros = np.zeros(len(memory.tensor_mb))
    _check_memory_feasible(zeros, zeros, 0.0, memory)


def _check_memory_feasible(t_dw, t_dy, budget, memory: MemoryCosts) -> None:
    """Raise InfeasibleMemoryError when no tensor that fits the time budget fits the memory one;
    the message names the smallest feasible ``--memory-mb`` (whole MiB, rounded up)."""
    peaks = memory.single_peaks_mb()
    in_time = single_tensor_costs_us(t_dw, t_dy) <= budget
    if np.any(in_time & (peaks <= memory.budget_mb)):
        return
    k = int(np.argmin(np.where(in_time, peaks, np.inf)))
    need = math.ceil(float(peaks[k]))
    raise InfeasibleMemoryError(
        f"memory budget {memory.budget_mb:.1f} MiB is below the smallest peak of any selection "
        f"(tensor {k} alone: {float(peaks[k]):.1f} MiB); pass --memory-mb {need} or more",
        min_memory_mb=float(need),
    )


def _check_feasible(t_dw, t_dy, budget, forward_us, t_full_us) -> None:
    """Raise InfeasibleBudgetError when not even one tensor fits in ``budget`` µs."""
    cheapest_us, k = min_feasible_backward_us(t_dw, t_dy)
    if cheapest_us <= budget:
        return
    msg = (
        f"backward budget {budget:.1f} us is below the cheapest single tensor "
        f"(tensor {k}: {cheapest_us:.1f} us); no tensor can be trained"
    )
    min_rho = float("nan")
    if forward_us is not None and t_full_us is not None and float(t_full_us) > 0:
        min_rho = (float(forward_us) + cheapest_us) / float(t_full_us)
        if min_rho <= 1.0:  # rounded up, so the rho the message names is feasible
            msg += f"; raise rho to at least {math.ceil(min_rho * 1e4) / 1e4:.4f}"
        else:
            msg += (
                f"; even rho=1 is infeasible (forward + cheapest tensor = {min_rho:.2f} x the "
                "measured full step): the profile is too noisy, profile again on a quieter machine "
                "(compile --repeats 10, or --profile-level thorough)"
            )
    else:
        msg += f"; raise the budget to at least {cheapest_us:.1f} us"
    raise InfeasibleBudgetError(msg, min_rho=min_rho)


# --------------------------------------------------------------------------------------------
# The shipped solver: O(N*T) sweep over the earliest selected tensor.


# --------------------------------------------------------------------------------------------
# Under a memory budget as well (issue #17): the same sweep with a 2-D knapsack table.


def _memory_units(memory: MemoryCosts) -> tuple[np.ndarray, np.ndarray, int]:
    """(per-tensor units int64 [N], earliest units int64 [N], budget units) in units of
    ``memory.resolution_mb``: costs rounded to the nearest unit, budget net of ``base_mb``
    rounded down (negative = nothing fits)."""
    unit = memory.resolution_mb
    net = memory.budget_mb - memory.base_mb
    if memory.floor_mb > memory.budget_mb or net < 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), -1
    tensor_units = np.rint(memory.tensor_mb / unit)
    earliest_units = np.rint(memory.earliest_mb / unit)
    # Beyond what the costliest selection needs the budget binds nothing, and the table's
    # memory axis would only grow (--memory-mb 100000 on ResNet50 asked for an 80 GiB table).
    most = int(tensor_units.sum() + (earliest_units.max() if earliest_units.size else 0))
    budget_units = min(math.floor(net / unit + 1e-9), most)
    if budget_units > MAX_TABLE_UNITS:
        raise ConfigError(
            f"memory budget of {budget_units} units is too large for the DP table; "
            "pass a coarser memory resolution"
        )
    clip = budget_units + 1  # a cost above the budget never fits: keep int64 sums exact
    tensor_units = np.minimum(tensor_units, clip).astype(np.int64)
    earliest_units = np.minimum(earliest_units, clip).astype(np.int64)
    return tensor_units, earliest_units, budget_units


def _solve_within_budgets(t_dw, t_dy, imp, budget, resolution, memory: MemoryCosts):
    """:func:`_solve_within_budget` under time and memory: the integer DP, then the real costs
    checked (time in µs, peak in MiB); a budget exceeded in real units is tightened and the DP
    re-run, so the mask returned fits both. The best single tensor fitting both is also
    considered."""
    w_dw, w_dy, budget_units = discretise(t_dw, t_dy, budget, resolution)
    m_dw, m_e, budget_m = _memory_units(memory)
    mask = None
    while budget_units >= 0 and budget_m >= 0:
        mask = dp_sweep_2d(w_dw, w_dy, imp, budget_units, m_dw, m_e, budget_m)
        if mask is None:
            break
        over_t = backward_us(mask, t_dw, t_dy) > budget
        excess_mb = memory.peak_mb(mask) - memory.budget_mb
        if not over_t and excess_mb <= 0:
            break
        budget_units -= int(over_t)
        budget_m -= max(1, math.ceil(excess_mb / memory.resolution_mb)) if excess_mb > 0 else 0
        mask = None
    single = best_single(t_dw, t_dy, imp, budget, memory)
    if mask is None or (single is not None and imp[single].sum() > imp[mask].sum()):
        mask = single
    return mask


def select_tensors(
    t_dw_us,
    t_dy_us,
    importance,
    budget_us: float,
    *,
    resolution: int | None = None,
    forward_us: float | None = None,
    t_full_us: float | None = None,
    memory: MemoryCosts | None = None,
) -> Selection:
    """Optimal tensor selection under a backward budget (paper Eq. 3, DP of §6).

    Maximises ``sum(M * importance)`` over non-empty masks M with
    ``sum(M * t_dw_us) + sum(t_dy_us[e(M):]) <= budget_us`` in O(N*T) time (see module docstring).

    Rounding (both conservative, so the returned mask never exceeds ``budget_us`` in real µs):
      * ``resolution=None``: timings are rounded UP to integer µs and the budget DOWN to an
        integer. Exact (the true optimum) when the timings are integers.
      * ``resolution=R`` (the paper's T_q, Eq. 5): the budget is split into R units of
        ``budget_us / R`` µs; timings are rounded UP to whole units. Near-optimal, T = R.
      In both modes the best single tensor fitting in real µs is also considered, so rounding
      never turns a feasible budget into an error.

    Args:
        t_dw_us, t_dy_us: float/int [N] µs (>= 0), forward order.
        importance: float [N], forward order; zero and negative values allowed.
        budget_us: backward budget in µs, ``rho * t_full_us - forward_us``
            (:func:`select_for_rho` computes it from a profile).
        resolution: None for 1-µs units, or a positive int R.
        forward_us, t_full_us: optional, only to state the smallest feasible rho in the error
            (``t_full_us``: the time model's full step T_full the budget was computed from).
        memory: a peak-memory budget as well (:class:`MemoryCosts`, issue #17): the mask then
            also satisfies ``memory.peak_mb(mask) <= memory.budget_mb`` in real MiB (2-D DP,
            module docstring).
    Returns:
        Selection with strategy ``"dp"``.
    Raises:
        InfeasibleBudgetError: no single tensor fits (message gives the smallest feasible budget,
            and rho when ``forward_us``/``t_full_us`` are given; attribute ``min_rho``).
        InfeasibleMemoryError: no tensor fitting the time budget fits the memory budget (the
            message gives the smallest feasible ``--memory-mb``; attribute ``min_memory_mb``).
        ConfigError: mismatched shapes, negative/non-finite timings or importance, N = 0, bad
            resolution, or an exact table larger than ``MAX_TABLE_UNITS`` (use ``resolution``).
    """
    t_dw, t_dy, imp, budget = _inputs(t_dw_us, t_dy_us, importance, budget_us)
    _check_feasible(t_dw, t_dy, budget, forward_us, t_full_us)
    if memory is None:
        mask = solve_within_budget(dp_sweep, t_dw, t_dy, imp, budget, resolution)
    else:
        memory = memory.checked(t_dw.size)
        _check_memory_feasible(t_dw, t_dy, budget, memory)
        mask = _solve_within_budgets(t_dw, t_dy, imp, budget, resolution, memory)
    return _result(mask, imp, t_dw, t_dy, "dp")


# --------------------------------------------------------------------------------------------
# The paper's recurrence, O(N^2 * T): oracle and benchmark baseline.


def select_naive_dp(
    t_dw_us,
    t_dy_us,
    importance,
    budget_us: float,
    *,
    resolution: int | None = None,
    forward_us: float | None = None,
    t_full_us: float | None = None,
) -> Selection:
    """The paper's O(N^2*T) DP (§6.2, Eq. 4); same contract and rounding as :func:`select_tensors`.

    Memory is O(N*T) (float64 scores + int32 back-pointers), so keep N*T below ~1e8.
    Returns a Selection with strategy ``"naive_dp"``.
    """
    t_dw, t_dy, imp, budget = _inputs(t_dw_us, t_dy_us, importance, budget_us)
    _check_feasible(t_dw, t_dy, budget, forward_us, t_full_us)
    mask = solve_within_budget(naive_recurrence, t_dw, t_dy, imp, budget, resolution)
    return _result(mask, imp, t_dw, t_dy, "naive_dp")


# --------------------------------------------------------------------------------------------
# Baselines under the same budget and time model.


def select_topk(
    t_dw_us,
    t_dy_us,
    importance,
    budget_us: float,
    *,
    resolution: int | None = None,
    forward_us: float | None = None,
    t_full_us: float | None = None,
) -> Selection:
    """Greedy top-k by importance under the same budget and time model.

    Visits tensors by importance, descending (ties: nearer the output first), and adds each one
    whose addition keeps ``backward_us(mask) <= budget_us``; tensors that do not fit are skipped.
    Tensors with importance <= 0 are only added when the mask would otherwise be empty (then the
    most important tensor that fits alone). ``resolution`` is accepted for a uniform signature
    and ignored (the greedy works in real µs).

    Returns a Selection with strategy ``"topk"``. Raises as :func:`select_tensors`.
    """
    del resolution
    t_dw, t_dy, imp, budget = _inputs(t_dw_us, t_dy_us, importance, budget_us)
    _check_feasible(t_dw, t_dy, budget, forward_us, t_full_us)
    n = t_dw.size
    suffix_dy = np.concatenate([np.cumsum(t_dy[::-1])[::-1], [0.0]])
    order = np.lexsort((-np.arange(n), -imp))  # importance desc, then index desc
    mask = np.zeros(n, dtype=bool)
    dw_sum, earliest = 0.0, n
    for k in order:
        if imp[k] <= 0:
            break
        new_earliest = min(earliest, int(k))
        if dw_sum + t_dw[k] + suffix_dy[new_earliest] <= budget:
            mask[k] = True
            dw_sum += t_dw[k]
            earliest = new_earliest
    if not mask.any():
        mask = best_single(t_dw, t_dy, imp, budget)
    return _result(mask, imp, t_dw, t_dy, "topk")


def select_backward_prefix(
    t_dw_us,
    t_dy_us,
    importance,
    budget_us: float,
    *,
    resolution: int | None = None,
    forward_us: float | None = None,
    t_full_us: float | None = None,
) -> Selection:
    """Longest prefix of the backward pass that fits: tensors s..N-1 with the smallest such s.

    The classic "train the last layers" transfer-learning baseline, sized to the budget. The
    backward pass runs from the output to the input, so its prefix is a suffix in forward order:
    the longest run of tensors ending at the output whose
    ``sum(t_dw[s:]) + sum(t_dy[s:]) <= budget_us``. Ignores importance (it only enters
    ``Selection.objective``). ``resolution`` is accepted for a uniform signature and ignored.

    Args:
        t_dw_us, t_dy_us: float/int [N] µs (>= 0), forward order.
        importance: float [N], forward order; used for the objective only.
        budget_us: backward budget in µs.
        forward_us, t_full_us: optional, only to state the smallest feasible rho in the error.

    Returns:
        Selection with strategy ``"prefix"`` (the CLI's strategy name).

    Raises:
        InfeasibleBudgetError: even the last tensor alone does not fit (``min_rho`` is this
            baseline's own minimum when ``forward_us``/``t_full_us`` are given).
        ConfigError: as :func:`select_tensors`.
    """
    del resolution
    t_dw, t_dy, imp, budget = _inputs(t_dw_us, t_dy_us, importance, budget_us)
    suffix_cost = np.cumsum((t_dw + t_dy)[::-1])[::-1]  # cost of training s..N-1
    fits = np.flatnonzero(suffix_cost <= budget)
    if fits.size == 0:
        _check_feasible(t_dw, t_dy, budget, forward_us, t_full_us)
        cheapest = float(suffix_cost[-1])
        msg = (
            f"backward budget {budget:.1f} us is below the cost of training the last tensor "
            f"alone ({cheapest:.1f} us)"
        )
        min_rho = float("nan")
        if forward_us is not None and t_full_us is not None and float(t_full_us) > 0:
            min_rho = (float(forward_us) + cheapest) / float(t_full_us)
            msg += f"; raise rho to at least {min_rho:.4f} for the prefix baseline"
        raise InfeasibleBudgetError(msg, min_rho=min_rho)
    mask = np.zeros(t_dw.size, dtype=bool)
    mask[int(fits[0]) :] = True
    return _result(mask, imp, t_dw, t_dy, "prefix")


# --------------------------------------------------------------------------------------------
# Strategies: the elastic DP and the baselines the runtime compares it with.


def select_for_rho(
    profile,
    rho: float,
    importance,
    *,
    strategy: str = "elastic",
    resolution: int | None = None,
    memory: MemoryCosts | None = None,
    tolerance: float = 0.0,
) -> Selection:
    """Budget of the step-time ratio ``rho``, then the budgeted ``strategy`` (paper Eq. 3).

    ``budget_us = rho * profile.t_full_us - profile.forward_us``
    (:func:`etgraph.timing.budget_us`), then:

    * ``"elastic"`` — the DP, :func:`select_tensors` (the paper's selection);
    * ``"topk"`` — greedy by importance, :func:`select_topk`;
    * ``"prefix"`` — the longest prefix of the backward pass that fits,
      :func:`select_backward_prefix`.

    With ``tolerance`` (a fraction, e.g. 0.05) rho is a target within ±``tolerance``, not only a
    ceiling: when the selection's predicted step falls short of ``(1 - tolerance) * rho *
    t_full_us`` (a model of few, coarse tensors: nothing between the selection and the budget
    fits), the strategy is solved again at ``rho * (1 + tolerance)`` and that selection is taken
    if its predicted step is closer to ``rho * t_full_us``. (Default model, 17 tensors, closed
    loop: its accurate time model put the selection measured at 1.02x rho just over the budget,
    and the next one below it ran at 0.80x.)

    Args:
        profile: anything with ``t_dw_us``, ``t_dy_us`` (float [N] µs, forward order),
            ``forward_us`` and ``t_full_us`` (µs; the time model's T_full), e.g. a
            :class:`etgraph.profile.Profile`.
        rho: requested step-time ratio ``T_selective / T_full`` in (0, 1].
        importance: float [N], forward order (:mod:`etgraph.importance`); required by
            ``elastic`` and ``topk``. ``prefix`` ignores it for the mask; None there scores
            every tensor 1 (objective = number of tensors).
        strategy: one of :data:`BUDGETED_STRATEGIES`.
        resolution: DP time resolution (``elastic``; see :func:`select_tensors`).
        memory: a peak-memory budget as well (``elastic`` only; :class:`MemoryCosts`).
        tolerance: in [0, 1); 0 (default) keeps rho a strict ceiling.

    Returns:
        The :class:`Selection`; ``backward_us <= budget_us`` (with ``tolerance``: the budget of
        ``rho * (1 + tolerance)``, capped at 1), the peak within ``memory.budget_mb``.

    Raises:
        InfeasibleBudgetError: ``rho`` is below what the forward pass plus the cheapest tensor
            (for ``prefix``: the last tensor) costs; the message gives the smallest feasible rho.
        InfeasibleMemoryError: no selection fits ``memory`` (gives the smallest budget).
        ConfigError: ``rho`` not in (0, 1], non-positive ``t_full_us``, an unknown strategy,
            missing importance, invalid timings/importance (as :func:`select_tensors`), or a
            memory budget with a strategy other than ``elastic``.
    """
    if memory is not None and strategy != "elastic":
        raise ConfigError(f"a memory budget works with the elastic strategy only, not {strategy!r}")
    if strategy not in BUDGETED_STRATEGIES:
        choices = ", ".join(BUDGETED_STRATEGIES)
        raise ConfigError(f"unknown budgeted strategy {strategy!r}: choose one of {choices}")
    if importance is None:
        if strategy != "prefix":
            raise ConfigError(f"strategy {strategy!r} needs the importance of every tensor")
        importance = np.ones(len(profile.t_dw_us))
    if not (0.0 <= tolerance < 1.0):
        raise ConfigError(f"rho tolerance must be in [0, 1), got {tolerance}")

    def solve(ratio: float) -> Selection:
        budget = timing.budget_us(ratio, profile.forward_us, profile.t_full_us)
        args = (profile.t_dw_us, profile.t_dy_us, importance, budget)
        kwargs = dict(forward_us=profile.forward_us, t_full_us=profile.t_full_us)
        if strategy == "elastic":
            return select_tensors(*args, resolution=resolution, memory=memory, **kwargs)
        if strategy == "topk":
            return select_topk(*args, **kwargs)
        return select_backward_prefix(*args, **kwargs)

    chosen = solve(rho)
    target_us = rho * float(profile.t_full_us)
    short_us = target_us - (float(profile.forward_us) + chosen.backward_us)
    if tolerance > 0.0 and short_us > tolerance * target_us:
        wider = solve(min(1.0, rho * (1.0 + tolerance)))
        if abs(float(profile.forward_us) + wider.backward_us - target_us) < short_us:
            chosen = wider
    return chosen


def strategy_mask(
    strategy: str,
    tensors: Sequence,
    profile,
    rho: float,
    importance: np.ndarray | None,
    *,
    resolution: int | None = None,
    memory: MemoryCosts | None = None,
    tolerance: float = 0.0,
) -> np.ndarray:
    """Selection mask (bool [N], forward order) of ``strategy`` for this period.

    Args:
        strategy: one of :data:`STRATEGIES`.
        tensors: the trainable tensors (:attr:`etgraph.model.LoadedModel.tensors`,
            ``TensorInfo`` with ``kind`` and ``layer``).
        profile: as :func:`select_for_rho` (``t_dw_us``, ``t_dy_us``, ``forward_us``,
            ``t_full_us``).
        rho: requested step-time ratio in (0, 1] (budgeted strategies only).
        importance: float [N] (``elastic`` and ``topk``; ignored otherwise).
        resolution: DP time resolution (``elastic``).
        memory: a peak-memory budget as well (``elastic`` only, :func:`select_for_rho`).
        tolerance: rho as a target within ±tolerance (:func:`select_for_rho`).

    Returns:
        A writable bool [N]. ``full``, ``last-layer``, ``bn-bias`` (normalisation gamma and
        beta, every bias, the output layer; TinyTL-style) and ``bias-only`` (BitFit: every
        bias and normalisation beta, the output layer) ignore ``rho``;
        ``elastic`` (paper Eq. 3 DP), ``topk`` and ``prefix`` (the longest prefix of the backward
        pass that fits) select under ``rho * t_full_us`` through :func:`select_for_rho`.

    Raises:
        InfeasibleBudgetError: ``rho`` is below what the forward pass (plus the cheapest
            tensor) costs; the message gives the smallest feasible rho.
        ConfigError: unknown strategy, or as :func:`select_for_rho`.
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if memory is not None and strategy != "elastic":
        raise ConfigError(f"a memory budget works with the elastic strategy only, not {strategy!r}")
    n = len(tensors)
    if strategy == "full":
        return np.ones(n, dtype=bool)
    last_layer = tensors[-1].layer
    if strategy == "last-layer":
        return np.array([t.layer == last_layer for t in tensors], dtype=bool)
    if strategy == "bn-bias":
        return np.array(
            [t.kind in ("gamma", "beta", "bias") or t.layer == last_layer for t in tensors],
            dtype=bool,
        )
    if strategy == "bias-only":
        return np.array(
            [t.kind in ("beta", "bias") or t.layer == last_layer for t in tensors], dtype=bool
        )
    if strategy == "prefix":
        importance = None  # the prefix ignores importance (runs without an importance pass)
    chosen = select_for_rho(
        profile,
        rho,
        importance,
        strategy=strategy,
        resolution=resolution,
        memory=memory,
        tolerance=tolerance,
    )
    return np.asarray(chosen.mask, dtype=bool).copy()
