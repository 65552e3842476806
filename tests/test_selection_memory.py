"""The DP under time and memory budgets (issue #17) against brute force, and its rounding."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from etgraph.errors import InfeasibleBudgetError, InfeasibleMemoryError
from etgraph.selection import MemoryCosts, check_memory_floor, select_tensors
from etgraph.timing import backward_us


def _brute(t_dw, t_dy, imp, budget, memory):
    """Best objective over every non-empty mask fitting both budgets (None if none fits)."""
    n = t_dw.size
    best = None
    for bits in itertools.product([False, True], repeat=n):
        mask = np.array(bits)
        if not mask.any():
            continue
        if backward_us(mask, t_dw, t_dy) > budget or memory.peak_mb(mask) > memory.budget_mb:
            continue
        value = float(imp[mask].sum())
        if best is None or value > best:
            best = value
    return best


def _instance(rng, n):
    t_dw = rng.integers(0, 8, n).astype(float)
    t_dy = rng.integers(0, 6, n).astype(float)
    imp = rng.normal(size=n)
    imp[rng.random(n) < 0.2] = 0.0
    tensor_mb = rng.integers(0, 10, n).astype(float)
    earliest_mb = np.sort(rng.integers(0, 30, n))[::-1].astype(float)
    if rng.random() < 0.3:  # not monotone: branches
        earliest_mb = rng.integers(0, 30, n).astype(float)
    base = float(rng.integers(0, 20))
    floor = float(rng.integers(0, 40))
    total_t = t_dw.sum() + t_dy.sum()
    budget = float(rng.integers(0, int(total_t) + 2))
    budget_mb = float(rng.integers(0, int(base + tensor_mb.sum() + earliest_mb.max()) + 3))
    memory = MemoryCosts(tensor_mb, earliest_mb, budget_mb, base_mb=base, floor_mb=floor)
    return t_dw, t_dy, imp, budget, memory


@pytest.mark.slow  # thousands of brute-force instances: the fast subset stays under 2 minutes
def test_dp_with_memory_matches_brute_force():
    """Exact on 1500 random integer instances (N <= 9): same objective as brute force, both
    budgets respected, and the infeasible cases are exactly the ones brute force finds none."""
    rng = np.random.default_rng(17)
    checked = feasible = 0
    for _ in range(1500):
        n = int(rng.integers(1, 10))
        t_dw, t_dy, imp, budget, memory = _instance(rng, n)
        expected = _brute(t_dw, t_dy, imp, budget, memory)
        try:
            sel = select_tensors(t_dw, t_dy, imp, budget, memory=memory)
        except InfeasibleBudgetError:
            assert expected is None
            checked += 1
            continue
        assert expected is not None
        assert sel.objective == pytest.approx(expected, abs=1e-9)
        assert sel.backward_us <= budget
        assert memory.peak_mb(sel.mask) <= memory.budget_mb
        checked += 1
        feasible += 1
    assert checked == 1500 and feasible > 500


def test_rounded_memory_never_exceeds_budget():
    """Real-valued memory at a coarse resolution: the selection never exceeds the budget in
    real MiB, and stays within the brute-force optimum."""
    rng = np.random.default_rng(3)
    for _ in range(500):
        n = int(rng.integers(1, 9))
        t_dw, t_dy, imp, budget, memory = _instance(rng, n)
        memory = MemoryCosts(
            memory.tensor_mb + rng.random(n) * 3,
            memory.earliest_mb + rng.random(n) * 3,
            memory.budget_mb + rng.random() * 5,
            base_mb=memory.base_mb,
            floor_mb=memory.floor_mb,
            resolution_mb=float(rng.choice([0.5, 1.0, 4.0])),
        )
        expected = _brute(t_dw, t_dy, imp, budget, memory)
        try:
            sel = select_tensors(t_dw, t_dy, imp, budget, memory=memory, resolution=7)
        except InfeasibleBudgetError:
            assert expected is None
            continue
        assert memory.peak_mb(sel.mask) <= memory.budget_mb
        assert sel.backward_us <= budget
        assert sel.objective <= expected + 1e-9


def test_memory_budget_changes_the_selection_and_names_the_minimum():
    t_dw = np.array([1.0, 1.0, 1.0, 1.0])
    t_dy = np.zeros(4)
    imp = np.array([4.0, 3.0, 2.0, 1.0])
    earliest = np.array([100.0, 50.0, 20.0, 0.0])
    memory = MemoryCosts(np.full(4, 10.0), earliest, 75.0, base_mb=5.0)
    sel = select_tensors(t_dw, t_dy, imp, 10.0, memory=memory)
    # e = 1 costs 5 + 50 + 10 per tensor: tensors 1 and 2 (75) fit, tensor 0 never does
    assert sel.mask.tolist() == [False, True, True, False]
    unconstrained = select_tensors(t_dw, t_dy, imp, 10.0)
    assert unconstrained.mask.all()
    with pytest.raises(InfeasibleMemoryError, match=r"pass --memory-mb 15 or more") as err:
        select_tensors(
            t_dw, t_dy, imp, 10.0, memory=MemoryCosts(np.full(4, 10.0), earliest, 14.5, 5.0)
        )
    assert err.value.min_memory_mb == 15.0
    floor = MemoryCosts(np.full(4, 10.0), earliest, 30.0, base_mb=5.0, floor_mb=31.2)
    with pytest.raises(InfeasibleMemoryError, match=r"--memory-mb 32 or more"):
        select_tensors(t_dw, t_dy, imp, 10.0, memory=floor)
    assert math.isnan(err.value.min_rho)


def test_a_memory_budget_beyond_every_selection_binds_nothing_and_costs_no_table(monkeypatch):
    """A budget above the costliest selection's peak is the time-only problem; the DP table's
    memory axis stops at what a selection can need (--memory-mb 100000 on ResNet50 once asked
    for an 80 GiB table)."""
    from etgraph import selection

    rng = np.random.default_rng(3)
    for _ in range(50):
        t_dw, t_dy, imp, budget, memory = _instance(rng, 6)
        huge = MemoryCosts(memory.tensor_mb, memory.earliest_mb, 1e7, base_mb=memory.base_mb)
        try:
            expected = select_tensors(t_dw, t_dy, imp, budget).mask
        except InfeasibleBudgetError:
            continue
        monkeypatch.setattr(selection, "MAX_TABLE_UNITS", 1000)  # 1e7 units would not pass
        got = select_tensors(t_dw, t_dy, imp, budget, memory=huge).mask
        monkeypatch.undo()
        assert imp[got].sum() == pytest.approx(imp[expected].sum())


def test_memory_floor_is_checked_without_a_time_budget():
    """Before a run measures anything: a budget below every tensor's own peak is refused with
    the smallest feasible --memory-mb; one at that peak passes."""
    memory = MemoryCosts(
        tensor_mb=np.array([5.0, 1.0, 3.0]),
        earliest_mb=np.array([40.0, 12.0, 2.0]),
        budget_mb=100.0,
        base_mb=100.0,
    )
    with pytest.raises(InfeasibleMemoryError, match=r"tensor 2 alone: 105.0 MiB.*--memory-mb 105"):
        check_memory_floor(memory)
    check_memory_floor(MemoryCosts(memory.tensor_mb, memory.earliest_mb, 105.0, base_mb=100.0))
