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

#: Largest DP table (budget in time units) the solvers accept; beyond it pass ``resolution``.
MAX_TABLE_UNITS = 1 << 26


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
                "measured full step): the profile is too noisy, re-profile with more --repeats "
                "on a quieter machine"
            )
    else:
        msg += f"; raise the budget to at least {cheapest_us:.1f} us"
    raise InfeasibleBudgetError(msg, min_rho=min_rho)


def _best_single(t_dw, t_dy, imp, budget, memory=None) -> np.ndarray | None:
    """Mask of the most important tensor that fits alone in ``budget`` µs (and in ``memory``'s
    budget), or None."""
    fits = single_tensor_costs_us(t_dw, t_dy) <= budget
    if memory is not None:
        fits &= memory.single_peaks_mb() <= memory.budget_mb
    if not fits.any():
        return None
    k = int(np.argmax(np.where(fits, imp, -np.inf)))
    mask = np.zeros(t_dw.size, dtype=bool)
    mask[k] = True
    return mask


def _discretise(t_dw, t_dy, budget, resolution):
    """Integer time units: timings rounded UP, budget rounded DOWN (conservative).

    Returns (w_dw int64 [N], w_dy int64 [N], budget_units int). With ``resolution=None`` the unit
    is 1 µs; otherwise the unit is ``budget / resolution`` so the budget is ``resolution`` units.
    A budget < 0 gives budget_units < 0 (nothing fits).
    """
    if resolution is not None and (int(resolution) != resolution or resolution < 1):
        raise ConfigError(f"resolution must be a positive integer, got {resolution}")
    # A budget <= 0, infinite, or too small to split (subnormal) falls back to 1-µs units.
    scaled = resolution is not None and math.isfinite(budget) and budget / int(resolution) > 0
    unit = budget / int(resolution) if scaled else 1.0
    with np.errstate(over="ignore"):  # a tiny unit may give inf units: clipped below
        units_dw = np.ceil(t_dw / unit)
        units_dy = np.ceil(t_dy / unit)
        total_units = float(units_dw.sum() + units_dy.sum())
    # Beyond the cost of full training the budget changes nothing: cap the table there.
    table_units = min(int(resolution) if scaled else budget, total_units)
    if table_units > MAX_TABLE_UNITS:
        raise ConfigError(
            f"budget of {table_units:.0f} time units is too large for an exact DP table "
            f"(limit {MAX_TABLE_UNITS}); pass resolution= (e.g. 10000)"
        )
    budget_units = math.floor(table_units) if budget >= 0 else -1
    # A timing above the budget never fits; clipping it to budget + 1 keeps int64 sums exact.
    w_dw = np.minimum(units_dw, budget_units + 1).astype(np.int64)
    w_dy = np.minimum(units_dy, budget_units + 1).astype(np.int64)
    return w_dw, w_dy, budget_units


def _solve_within_budget(solve_units, t_dw, t_dy, imp, budget, resolution):
    """Run an integer-unit solver, then guarantee the real-µs cost fits and the mask is non-empty.

    ``solve_units(w_dw, w_dy, imp, budget_units) -> mask | None``. Rounding timings up and the
    budget down already guarantees ``backward_us(mask) <= budget`` in exact arithmetic; the loop
    only guards against floating-point noise in the conversion to units. The best single tensor
    that fits in real µs is also considered, so coarse rounding never makes a feasible budget
    look infeasible.
    """
    w_dw, w_dy, budget_units = _discretise(t_dw, t_dy, budget, resolution)
    mask = None
    while budget_units >= 0:
        mask = solve_units(w_dw, w_dy, imp, budget_units)
        if mask is None or backward_us(mask, t_dw, t_dy) <= budget:
            break
        budget_units -= 1
        mask = None
    single = _best_single(t_dw, t_dy, imp, budget)
    if mask is None or (single is not None and imp[single].sum() > imp[mask].sum()):
        mask = single
    log.debug(
        "%s: N=%d, budget %.1f us = %d units, selected %d tensors",
        solve_units.__name__,
        t_dw.size,
        budget,
        budget_units,
        int(mask.sum()),
    )
    return mask


# --------------------------------------------------------------------------------------------
# The shipped solver: O(N*T) sweep over the earliest selected tensor.


def _dp_sweep(w_dw: np.ndarray, w_dy: np.ndarray, imp: np.ndarray, budget: int):
    """Exact optimum of the integer problem; mask (bool [N]) or None when nothing fits.

    Sweep e = N-1 .. 0. Before evaluating e, ``F[t]`` (t = 0 .. L-1) is the best importance of a
    subset of the positive-importance tensors e+1..N-1 whose ``w_dw`` sum to at most t; for
    t >= L the value equals ``F[L-1]`` (either every added tensor fits, or no query needs t >= L).
    Choosing e as the earliest selected tensor leaves ``cap[e] = budget - w_dw[e] - sum(w_dy[e:])``
    for the tensors after it, so ``value(e) = imp[e] + F[min(cap[e], L-1)]`` if ``cap[e] >= 0``.
    Then tensor e is added to the table as a 0/1-knapsack item, recording per capacity whether it
    was taken (bit-packed), which recovers the mask afterwards. Tensors with importance <= 0 are
    never worth adding besides the mandatory earliest one, so they skip the table.
    Table length is bounded by ``need[e] = max(cap[:e])`` (the largest capacity any earlier e
    will query — the paper's "redundant subproblems") and by the weight added so far.
    """
    n = w_dw.size
    suffix_dy = np.cumsum(w_dy[::-1])[::-1]
    cap = budget - w_dw - suffix_dy  # int64 [N]
    need = np.maximum.accumulate(cap)  # need[e-1]: largest capacity queried by any e' < e
    if need[-1] < 0:
        return None
    table = np.zeros(int(need[-1]) + 1, dtype=np.float64)
    candidate_buf = np.empty_like(table)  # reused scratch: no allocation per item
    keep_buf = np.empty(table.size, dtype=bool)
    length = 1  # active length L of the table
    added_w = 0  # total weight of the items in the table
    taken: dict[int, tuple[int, int, np.ndarray | None]] = {}  # item -> (w, L, packed bits)

    # Python scalars: the loop body is a handful of numpy calls, scalar indexing would dominate.
    cap_l, need_l, w_l, imp_l = cap.tolist(), need.tolist(), w_dw.tolist(), imp.tolist()
    best_value, best_e = -np.inf, -1
    for e in range(n - 1, -1, -1):
        if cap_l[e] >= 0:
            value = imp_l[e] + table[min(cap_l[e], length - 1)]
            if value > best_value:
                best_value, best_e = value, e
        if e == 0 or need_l[e - 1] < 0:
            break  # no earlier tensor can be the earliest selected one
        if imp_l[e] <= 0:
            continue
        w, v = w_l[e], imp_l[e]
        new_length = min(need_l[e - 1], added_w + w) + 1
        if new_length > length:  # the table grew: the tail holds "every item fits"
            table[length:new_length] = table[length - 1]
        length = new_length
        added_w += w
        if w >= length:
            continue  # never fits in any capacity still queried
        if w == 0:
            table[:length] += v
            taken[e] = (0, length, None)  # taken at every capacity
            continue
        candidate = np.add(table[: length - w], v, out=candidate_buf[: length - w])
        keep = np.greater(candidate, table[w:length], out=keep_buf[: length - w])
        np.maximum(table[w:length], candidate, out=table[w:length])
        taken[e] = (w, length, np.packbits(keep))

    if best_e < 0:
        return None
    mask = np.zeros(n, dtype=bool)
    mask[best_e] = True
    c = int(cap[best_e])
    for j in range(best_e + 1, n):  # undo the additions, last-added first
        if j not in taken:
            continue
        w, length_j, bits = taken[j]
        t = min(c, length_j - 1)
        # np.packbits is big-endian within a byte: bit i is (byte i // 8) >> (7 - i % 8).
        if bits is None or (t >= w and (bits[(t - w) >> 3] >> (7 - ((t - w) & 7))) & 1):
            mask[j] = True
            c -= w
    return mask


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


def _dp_sweep_2d(w_dw, w_dy, imp, budget, m_dw, m_e, budget_m):
    """Exact optimum of the integer problem with time and memory; mask (bool [N]) or None.

    As :func:`_dp_sweep`, with a table ``F[t, m]`` (best importance of a subset of the
    positive-importance tensors after e within t time units and m memory units). Choosing e as
    the earliest selected tensor leaves ``cap_t[e] = budget - w_dw[e] - sum(w_dy[e:])`` and
    ``cap_m[e] = budget_m - m_e[e] - m_dw[e]`` for the tensors after it. Each dimension's table
    length is bounded by the largest capacity an earlier e queries and by the weight added so
    far (beyond either, ``F`` is constant along that axis).
    """
    n = w_dw.size
    suffix_dy = np.cumsum(w_dy[::-1])[::-1]
    cap_t = budget - w_dw - suffix_dy
    cap_m = budget_m - m_e - m_dw
    ok = (cap_t >= 0) & (cap_m >= 0)
    # need[e-1]: largest capacity any e' < e queries (only e' that can be the earliest).
    need_t = np.maximum.accumulate(np.where(ok, cap_t, -1))
    need_m = np.maximum.accumulate(np.where(ok, cap_m, -1))
    if need_t[-1] < 0:
        return None
    table = np.zeros((int(need_t[-1]) + 1, int(need_m[-1]) + 1), dtype=np.float64)
    scratch = np.empty_like(table)
    keep_buf = np.empty(table.shape, dtype=bool)
    len_t = len_m = 1
    added_t = added_m = 0
    taken: dict[int, tuple[int, int, int, int, np.ndarray | None]] = {}

    cap_t_l, cap_m_l, ok_l = cap_t.tolist(), cap_m.tolist(), ok.tolist()
    need_t_l, need_m_l = need_t.tolist(), need_m.tolist()
    wt_l, wm_l, imp_l = w_dw.tolist(), m_dw.tolist(), imp.tolist()
    best_value, best_e = -np.inf, -1
    for e in range(n - 1, -1, -1):
        if ok_l[e]:
            value = imp_l[e] + table[min(cap_t_l[e], len_t - 1), min(cap_m_l[e], len_m - 1)]
            if value > best_value:
                best_value, best_e = value, e
        if e == 0 or need_t_l[e - 1] < 0:
            break
        if imp_l[e] <= 0:
            continue
        wt, wm, v = wt_l[e], wm_l[e], imp_l[e]
        new_t = min(need_t_l[e - 1], added_t + wt) + 1
        new_m = min(need_m_l[e - 1], added_m + wm) + 1
        if new_t > len_t:
            table[len_t:new_t, :len_m] = table[len_t - 1, :len_m]
        if new_m > len_m:
            table[:new_t, len_m:new_m] = table[:new_t, len_m - 1 : len_m]
        len_t, len_m = new_t, new_m
        added_t += wt
        added_m += wm
        if wt >= len_t or wm >= len_m:
            continue  # never fits in any capacity still queried
        if wt == 0 and wm == 0:
            table[:len_t, :len_m] += v
            taken[e] = (0, 0, len_t, len_m, None)
            continue
        rows, cols = len_t - wt, len_m - wm
        cand = np.add(table[:rows, :cols], v, out=scratch[:rows, :cols])
        target = table[wt:len_t, wm:len_m]
        keep = np.greater(cand, target, out=keep_buf[:rows, :cols])
        np.maximum(target, cand, out=target)
        taken[e] = (wt, wm, len_t, len_m, np.packbits(keep, axis=None))

    if best_e < 0:
        return None
    mask = np.zeros(n, dtype=bool)
    mask[best_e] = True
    ct, cm = int(cap_t[best_e]), int(cap_m[best_e])
    for j in range(best_e + 1, n):  # undo the additions, last-added first
        if j not in taken:
            continue
        wt, wm, lt, lm, bits = taken[j]
        t, m = min(ct, lt - 1), min(cm, lm - 1)
        if bits is None:
            hit = True
        elif t >= wt and m >= wm:
            i = (t - wt) * (lm - wm) + (m - wm)  # row-major index in the keep array
            hit = bool((bits[i >> 3] >> (7 - (i & 7))) & 1)
        else:
            hit = False
        if hit:
            mask[j] = True
            ct -= wt
            cm -= wm
    return mask


def _solve_within_budgets(t_dw, t_dy, imp, budget, resolution, memory: MemoryCosts):
    """:func:`_solve_within_budget` under time and memory: the integer DP, then the real costs
    checked (time in µs, peak in MiB); a budget exceeded in real units is tightened and the DP
    re-run, so the mask returned fits both. The best single tensor fitting both is also
    considered."""
    w_dw, w_dy, budget_units = _discretise(t_dw, t_dy, budget, resolution)
    m_dw, m_e, budget_m = _memory_units(memory)
    mask = None
    while budget_units >= 0 and budget_m >= 0:
        mask = _dp_sweep_2d(w_dw, w_dy, imp, budget_units, m_dw, m_e, budget_m)
        if mask is None:
            break
        over_t = backward_us(mask, t_dw, t_dy) > budget
        excess_mb = memory.peak_mb(mask) - memory.budget_mb
        if not over_t and excess_mb <= 0:
            break
        budget_units -= int(over_t)
        budget_m -= max(1, math.ceil(excess_mb / memory.resolution_mb)) if excess_mb > 0 else 0
        mask = None
    single = _best_single(t_dw, t_dy, imp, budget, memory)
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
        mask = _solve_within_budget(_dp_sweep, t_dw, t_dy, imp, budget, resolution)
    else:
        memory = memory.checked(t_dw.size)
        _check_memory_feasible(t_dw, t_dy, budget, memory)
        mask = _solve_within_budgets(t_dw, t_dy, imp, budget, resolution, memory)
    return _result(mask, imp, t_dw, t_dy, "dp")


# --------------------------------------------------------------------------------------------
# The paper's recurrence, O(N^2 * T): oracle and benchmark baseline.


def _naive_recurrence(w_dw: np.ndarray, w_dy: np.ndarray, imp: np.ndarray, budget: int):
    """The paper's §6.2 recurrence (Eq. 4) with the inclusive f(M); mask or None.

    The paper counts tensors from the output ("bottom k tensors"). ``S[k][t]`` is the best
    importance over masks on tensors k..N-1 in which tensor k is selected and is the one nearest
    the input, within t units. Selecting k costs ``dt = t_dw[k] + sum_{j=k}^{k_c-1} t_dy[j]`` on
    top of the subproblem of the closest selected tensor ``k_c`` (Eq. 4; the inclusive f(M) counts
    k's own t_dy), or ``t_dw[k] + sum(t_dy[k:])`` if k is the only one. Backtracing all k_c makes
    each subproblem O(N), hence O(N^2 * T); the loop over t is vectorised with numpy. The paper's
    P[k,t] (best over tensors k..N-1, any earliest) is ``max_{k' >= k} S[k'][t]``; the answer is
    ``max_k S[k][budget]``. (The paper's "Case 2 falls back to P[k_c, t - dt]" needs k_c to be
    selected, which is why the table is over S.)
    """
    n = w_dw.size
    if budget < 0:
        return None
    size = budget + 1
    suffix_dy = np.concatenate([np.cumsum(w_dy[::-1])[::-1], [0]])
    score = np.full((n, size), -np.inf)
    choice = np.full((n, size), -1, dtype=np.int32)  # k_c, or n for "k alone"
    for k in range(n - 1, -1, -1):
        best = np.full(size, -np.inf)
        arg = np.full(size, -1, dtype=np.int32)
        alone = int(w_dw[k] + suffix_dy[k])
        if alone < size:
            best[alone:] = 0.0
            arg[alone:] = n
        for k_c in range(k + 1, n):
            dt = int(w_dw[k] + suffix_dy[k] - suffix_dy[k_c])
            if dt >= size:
                continue
            cand = score[k_c, : size - dt]
            better = cand > best[dt:]
            best[dt:][better] = cand[better]
            arg[dt:][better] = k_c
        score[k] = imp[k] + best
        choice[k] = arg
    best_e = int(np.argmax(score[:, budget]))
    if not np.isfinite(score[best_e, budget]):
        return None
    mask = np.zeros(n, dtype=bool)
    k, t = best_e, budget
    while k < n:
        mask[k] = True
        k_c = int(choice[k, t])
        if k_c < n:
            t -= int(w_dw[k] + suffix_dy[k] - suffix_dy[k_c])
        k = k_c
    return mask


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
    mask = _solve_within_budget(_naive_recurrence, t_dw, t_dy, imp, budget, resolution)
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
        mask = _best_single(t_dw, t_dy, imp, budget)
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
