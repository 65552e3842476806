"""The dynamic programs behind :mod:`etgraph.selection` (paper §6): integer time (and memory)
units, the O(N*T) sweep over the earliest selected tensor with a 0/1-knapsack table over the
tensors after it, its 2-D form under a memory budget, and the paper's O(N^2*T) recurrence (the
tests' oracle). Pure numpy; the public solvers and their docs are :mod:`etgraph.selection`'s.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from etgraph.errors import ConfigError
from etgraph.timing import backward_us, single_tensor_costs_us

log = logging.getLogger(__name__)

__all__ = [
    "best_single",
    "discretise",
    "dp_sweep",
    "dp_sweep_2d",
    "naive_recurrence",
    "solve_within_budget",
]

#: Largest DP table (budget in time units) the solvers accept; beyond it pass ``resolution``.
MAX_TABLE_UNITS = 1 << 26


def best_single(t_dw, t_dy, imp, budget, memory=None) -> np.ndarray | None:
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


def discretise(t_dw, t_dy, budget, resolution):
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


def solve_within_budget(solve_units, t_dw, t_dy, imp, budget, resolution):
    """Run an integer-unit solver, then guarantee the real-µs cost fits and the mask is non-empty.

    ``solve_units(w_dw, w_dy, imp, budget_units) -> mask | None``. Rounding timings up and the
    budget down already guarantees ``backward_us(mask) <= budget`` in exact arithmetic; the loop
    only guards against floating-point noise in the conversion to units. The best single tensor
    that fits in real µs is also considered, so coarse rounding never makes a feasible budget
    look infeasible.
    """
    w_dw, w_dy, budget_units = discretise(t_dw, t_dy, budget, resolution)
    mask = None
    while budget_units >= 0:
        mask = solve_units(w_dw, w_dy, imp, budget_units)
        if mask is None or backward_us(mask, t_dw, t_dy) <= budget:
            break
        budget_units -= 1
        mask = None
    single = best_single(t_dw, t_dy, imp, budget)
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


def dp_sweep(w_dw: np.ndarray, w_dy: np.ndarray, imp: np.ndarray, budget: int):
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


def dp_sweep_2d(w_dw, w_dy, imp, budget, m_dw, m_e, budget_m):
    """Exact optimum of the integer problem with time and memory; mask (bool [N]) or None.

    As :func:`dp_sweep`, with a table ``F[t, m]`` (best importance of a subset of the
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


def naive_recurrence(w_dw: np.ndarray, w_dy: np.ndarray, imp: np.ndarray, budget: int):
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
