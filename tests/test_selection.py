"""Tensor selectors (paper Eq. 3 and §6) against brute force over all 2^N masks."""

from __future__ import annotations

import itertools
import math
from functools import cache
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etgraph.errors import ConfigError, InfeasibleBudgetError
from etgraph.model import TensorInfo
from etgraph.selection import (
    BUDGETED_STRATEGIES,
    MAX_TABLE_UNITS,
    STRATEGIES,
    Selection,
    select_backward_prefix,
    select_for_rho,
    select_naive_dp,
    select_tensors,
    select_topk,
    strategy_mask,
)
from etgraph.timing import backward_us, backward_us_many, budget_us, min_feasible_rho

SOLVERS = [select_tensors, select_naive_dp]
ALL_SELECTORS = [select_tensors, select_naive_dp, select_topk, select_backward_prefix]
#: The message of InfeasibleBudgetError when not even one tensor fits.
NO_TENSOR_FITS = "below the cheapest single tensor"


@cache
def all_masks(n: int) -> np.ndarray:
    """Every non-empty mask over n tensors, bool [2^n - 1, n]."""
    return np.array(list(itertools.product([False, True], repeat=n)), dtype=bool)[1:]


def brute_force(t_dw, t_dy, importance, budget):
    """(best objective, cost of every mask, objective of every mask); best is None if infeasible."""
    masks = all_masks(len(t_dw))
    # Cost written from the definition, independently of etgraph.timing's implementation.
    suffix_dy = np.cumsum(np.asarray(t_dy, float)[::-1])[::-1]
    cost = masks @ np.asarray(t_dw, float) + suffix_dy[masks.argmax(axis=1)]
    value = masks @ np.asarray(importance, float)
    ok = cost <= budget
    return (value[ok].max() if ok.any() else None), cost, value


def random_instance(rng, n_max=12, t_max=12):
    n = int(rng.integers(1, n_max + 1))
    zero_p = rng.uniform(0, 0.5)
    t_dw = np.where(rng.random(n) < zero_p, 0, rng.integers(0, t_max, n))
    t_dy = np.where(rng.random(n) < zero_p, 0, rng.integers(0, t_max, n))
    importance = rng.integers(-4, 10, n).astype(float)
    importance[rng.random(n) < 0.2] = 0.0
    if rng.random() < 0.3:  # real-valued importances too
        importance = importance + rng.normal(0, 1, n)
    total = t_dw.sum() + t_dy.sum()
    budget = int(rng.integers(-1, total + 3))
    return t_dw, t_dy, importance, budget


def check_selection(sel: Selection, t_dw, t_dy, importance, budget, strategy):
    assert isinstance(sel, Selection)
    assert sel.strategy == strategy
    assert sel.mask.dtype == bool and sel.mask.shape == (len(t_dw),)
    assert sel.count >= 1
    assert sel.backward_us <= budget
    assert sel.backward_us == pytest.approx(backward_us(sel.mask, t_dw, t_dy))
    assert sel.objective == pytest.approx(float(np.sum(np.asarray(importance)[sel.mask])))
    assert sel.indices.tolist() == np.flatnonzero(sel.mask).tolist()


def test_dp_matches_brute_force_on_thousands_of_instances():
    rng = np.random.default_rng(20230618)
    feasible = infeasible = 0
    for _ in range(3000):
        t_dw, t_dy, importance, budget = random_instance(rng)
        best, _, _ = brute_force(t_dw, t_dy, importance, budget)
        if best is None:
            infeasible += 1
            with pytest.raises(InfeasibleBudgetError, match=NO_TENSOR_FITS):
                select_tensors(t_dw, t_dy, importance, budget)
            continue
        feasible += 1
        sel = select_tensors(t_dw, t_dy, importance, budget)
        check_selection(sel, t_dw, t_dy, importance, budget, "dp")
        assert sel.objective == pytest.approx(best, abs=1e-9)
    assert feasible > 2000 and infeasible > 20  # both branches really exercised


def test_naive_paper_dp_matches_brute_force():
    rng = np.random.default_rng(7)
    for _ in range(600):
        t_dw, t_dy, importance, budget = random_instance(rng, n_max=10)
        best, _, _ = brute_force(t_dw, t_dy, importance, budget)
        if best is None:
            with pytest.raises(InfeasibleBudgetError, match=NO_TENSOR_FITS):
                select_naive_dp(t_dw, t_dy, importance, budget)
            continue
        sel = select_naive_dp(t_dw, t_dy, importance, budget)
        check_selection(sel, t_dw, t_dy, importance, budget, "naive_dp")
        assert sel.objective == pytest.approx(best, abs=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_dp_matches_naive_on_larger_instances(seed):
    rng = np.random.default_rng(seed)
    n = 60
    t_dw = rng.integers(0, 40, n)
    t_dy = np.where(rng.random(n) < 0.3, 0, rng.integers(0, 30, n))
    importance = rng.normal(0.5, 1.0, n)
    budget = int(rng.uniform(0.2, 0.9) * (t_dw.sum() + t_dy.sum()))
    ours = select_tensors(t_dw, t_dy, importance, budget)
    naive = select_naive_dp(t_dw, t_dy, importance, budget)
    assert ours.objective == pytest.approx(naive.objective, abs=1e-9)
    assert ours.backward_us <= budget and naive.backward_us <= budget


def test_paper_example_selection():
    # Seven tensors; the two most important are 3 and 4 (paper's example mask [0,0,0,1,1,0,0]).
    t_dw = np.array([5, 5, 5, 5, 5, 5, 5])
    t_dy = np.array([9, 9, 9, 1, 1, 1, 1])
    importance = np.array([0.1, 0.1, 0.1, 5.0, 4.0, 0.0, 0.0])
    budget = 5 + 5 + 4  # t_dw[3] + t_dw[4] + sum(t_dy[3:])
    sel = select_tensors(t_dw, t_dy, importance, budget)
    assert sel.mask.astype(int).tolist() == [0, 0, 0, 1, 1, 0, 0]
    assert sel.backward_us == 14.0 and sel.objective == 9.0
    # One µs less and only one of them fits.
    assert select_tensors(t_dw, t_dy, importance, budget - 1).indices.tolist() == [3]


@settings(max_examples=300, deadline=None)
@given(
    st.data(),
    st.integers(1, 12),
    st.integers(1, 400),
    st.floats(0.0, 1.2),
)
def test_resolution_never_exceeds_budget(data, n, resolution, budget_frac):
    floats = st.floats(0.0, 1e4, allow_nan=False, allow_infinity=False)
    t_dw = np.array(data.draw(st.lists(floats, min_size=n, max_size=n)))
    t_dy = np.array(data.draw(st.lists(floats, min_size=n, max_size=n)))
    importance = np.array(
        data.draw(st.lists(st.floats(-10, 10, allow_nan=False), min_size=n, max_size=n))
    )
    budget = budget_frac * float(t_dw.sum() + t_dy.sum())
    best, cost, value = brute_force(t_dw, t_dy, importance, budget)
    for solver in SOLVERS:
        if best is None:
            with pytest.raises(InfeasibleBudgetError, match=NO_TENSOR_FITS):
                solver(t_dw, t_dy, importance, budget, resolution=resolution)
            continue
        sel = solver(t_dw, t_dy, importance, budget, resolution=resolution)
        check_selection(sel, t_dw, t_dy, importance, budget, sel.strategy)
        assert sel.objective <= best + 1e-9
        # Never worse than the best single tensor that fits in real µs.
        single = all_masks(n).sum(axis=1) == 1
        assert sel.objective >= value[single & (cost <= budget)].max() - 1e-9


def test_float_timings_exact_mode_rounds_up_and_fits():
    rng = np.random.default_rng(3)
    for _ in range(500):
        n = int(rng.integers(1, 11))
        t_dw = rng.uniform(0, 8, n)
        t_dy = rng.uniform(0, 8, n) * (rng.random(n) < 0.7)
        importance = rng.normal(1, 1, n)
        budget = rng.uniform(0, 1.1) * (t_dw.sum() + t_dy.sum())
        best_real, _, _ = brute_force(t_dw, t_dy, importance, budget)
        if best_real is None:
            continue
        sel = select_tensors(t_dw, t_dy, importance, budget)
        check_selection(sel, t_dw, t_dy, importance, budget, "dp")
        # Documented: exact for timings rounded UP to µs and the budget rounded DOWN.
        best_rounded, _, _ = brute_force(
            np.ceil(t_dw), np.ceil(t_dy), importance, math.floor(budget)
        )
        floor = -np.inf if best_rounded is None else best_rounded
        assert floor - 1e-9 <= sel.objective <= best_real + 1e-9


def test_fine_resolution_is_close_to_exact():
    rng = np.random.default_rng(11)
    n = 80
    t_dw = rng.integers(1, 200, n)
    t_dy = rng.integers(0, 300, n)
    importance = rng.gamma(0.7, 1.0, n)
    budget = 0.5 * (t_dw.sum() + t_dy.sum())
    exact = select_tensors(t_dw, t_dy, importance, budget)
    coarse = select_tensors(t_dw, t_dy, importance, budget, resolution=100)
    fine = select_tensors(t_dw, t_dy, importance, budget, resolution=5000)
    assert coarse.objective <= fine.objective + 1e-9 <= exact.objective + 2e-9
    assert fine.objective >= 0.97 * exact.objective
    assert max(coarse.backward_us, fine.backward_us, exact.backward_us) <= budget


def test_infeasible_budget_reports_min_rho():
    t_dw = np.array([3.0, 2.0, 50.0])
    t_dy = np.array([10.0, 0.0, 4.0])
    forward, full = 100.0, 100.0 + 55.0 + 14.0
    rho = min_feasible_rho(t_dw, t_dy, forward, full)
    assert rho == pytest.approx((forward + 6.0) / full)  # tensor 1 alone: 2 + 0 + 4
    for solver in ALL_SELECTORS[:3]:
        with pytest.raises(InfeasibleBudgetError, match=r"rho to at least 0\.627") as err:
            solver(t_dw, t_dy, np.ones(3), 5.9, forward_us=forward, t_full_us=full)
        assert err.value.min_rho == pytest.approx(rho)
        assert "tensor 1" in str(err.value)
        with pytest.raises(InfeasibleBudgetError, match=r"at least 6\.0 us") as err:
            solver(t_dw, t_dy, np.ones(3), -20.0)
        assert math.isnan(err.value.min_rho)
        assert solver(t_dw, t_dy, np.ones(3), 6.0).indices.tolist() == [1]
    # The prefix baseline needs the last tensor: its own, larger, minimum.
    with pytest.raises(InfeasibleBudgetError, match="last tensor") as err:
        select_backward_prefix(t_dw, t_dy, np.ones(3), 20.0, forward_us=forward, t_full_us=full)
    assert err.value.min_rho == pytest.approx((forward + 54.0) / full)
    # Resolution mode: rounding may not make a feasible budget infeasible.
    sel = select_tensors(t_dw, t_dy, np.ones(3), 6.0, resolution=1)
    assert sel.indices.tolist() == [1]


def test_baselines_respect_budget_and_dp_dominates():
    rng = np.random.default_rng(5)
    for _ in range(800):
        t_dw, t_dy, importance, budget = random_instance(rng, n_max=9)
        best, cost, _ = brute_force(t_dw, t_dy, importance, budget)
        if best is None:
            continue
        dp = select_tensors(t_dw, t_dy, importance, budget)
        topk = select_topk(t_dw, t_dy, importance, budget)
        check_selection(topk, t_dw, t_dy, importance, budget, "topk")
        assert topk.objective <= dp.objective + 1e-9
        # Greedy: no skipped positive-importance tensor would still fit.
        for k in np.flatnonzero(~topk.mask & (importance > 0)):
            grown = topk.mask.copy()
            grown[k] = True
            assert backward_us(grown, t_dw, t_dy) > budget
        n = len(t_dw)
        suffix_cost = [t_dw[s:].sum() + t_dy[s:].sum() for s in range(n)]
        if suffix_cost[-1] > budget:
            with pytest.raises(
                InfeasibleBudgetError, match=f"{NO_TENSOR_FITS}|the last tensor alone"
            ):
                select_backward_prefix(t_dw, t_dy, importance, budget)
            continue
        prefix = select_backward_prefix(t_dw, t_dy, importance, budget)
        check_selection(prefix, t_dw, t_dy, importance, budget, "prefix")
        start = int(prefix.indices[0])
        assert prefix.indices.tolist() == list(range(start, n))  # a suffix in forward order
        assert start == 0 or suffix_cost[start - 1] > budget  # and the longest that fits
        assert prefix.objective <= dp.objective + 1e-9


def test_topk_order_and_nonpositive_importance():
    t_dw = np.array([1.0, 1.0, 1.0, 1.0])
    t_dy = np.zeros(4)
    # Budget for two tensors: greedy takes the two most important.
    sel = select_topk(t_dw, t_dy, np.array([0.5, 3.0, 1.0, 2.0]), 2.0)
    assert sel.indices.tolist() == [1, 3]
    # Negative/zero importances are not added just because they fit...
    sel = select_topk(t_dw, t_dy, np.array([-1.0, 2.0, 0.0, -3.0]), 10.0)
    assert sel.indices.tolist() == [1]
    # ...but the mask is never empty.
    sel = select_topk(t_dw, t_dy, np.array([-1.0, -2.0, -0.5, -3.0]), 10.0)
    assert sel.indices.tolist() == [2]


def test_zero_timings_and_nonpositive_importance():
    n = 6
    zeros = np.zeros(n)
    importance = np.array([1.0, -1.0, 0.0, 2.0, -0.5, 3.0])
    sel = select_tensors(zeros, zeros, importance, 0.0)
    assert sel.objective == 6.0 and sel.backward_us == 0.0
    assert set(sel.indices.tolist()) >= {0, 3, 5} and not sel.mask[[1, 4]].any()
    # All importances negative: still one tensor, the least harmful one that fits.
    sel = select_tensors(np.ones(n), np.ones(n), -np.arange(1.0, n + 1), 3.0)
    assert sel.indices.tolist() == [4]  # tensor 5 (-6) or 4 (-5, costs 1 + 2 = 3)


def test_tiny_budgets_with_resolution():
    t_dw = np.array([0.0, 1.0, 0.0])
    t_dy = np.array([0.0, 2.0, 0.0])
    importance = np.array([1.0, 5.0, 2.0])
    for budget in (5e-324, 1e-300, 1e-12, 0.0):
        sel = select_tensors(t_dw, t_dy, importance, budget, resolution=1000)
        assert sel.indices.tolist() == [2] and sel.backward_us == 0.0
    with pytest.raises(InfeasibleBudgetError, match=NO_TENSOR_FITS):
        select_tensors(np.ones(3), np.ones(3), importance, 1e-300, resolution=1000)


def test_unbounded_and_huge_budgets():
    t_dw = np.array([4, 5, 6])
    t_dy = np.array([1, 2, 3])
    importance = np.array([1.0, -1.0, 2.0])
    for budget in (1e9, float("inf")):
        sel = select_tensors(t_dw, t_dy, importance, budget)
        assert sel.indices.tolist() == [0, 2]
    huge = np.full(3, MAX_TABLE_UNITS, dtype=float)
    with pytest.raises(ConfigError, match="resolution"):
        select_tensors(huge, huge, importance, 5 * MAX_TABLE_UNITS)
    sel = select_tensors(huge, huge, importance, 5 * MAX_TABLE_UNITS, resolution=1000)
    assert sel.indices.tolist() == [0, 2]


def test_selection_is_immutable():
    sel = select_tensors(np.ones(3), np.ones(3), np.ones(3), 10.0)
    with pytest.raises(ValueError, match="read-only"):
        sel.mask[0] = False
    with pytest.raises(AttributeError, match="cannot assign to field"):
        sel.objective = 0.0  # type: ignore[misc]


@pytest.mark.parametrize("solver", ALL_SELECTORS)
def test_input_validation(solver):
    with pytest.raises(ConfigError, match="importance"):
        solver(np.ones(3), np.ones(3), np.ones(2), 10.0)
    with pytest.raises(ConfigError, match="NaN"):
        solver(np.ones(2), np.ones(2), np.array([1.0, np.nan]), 10.0)
    with pytest.raises(ConfigError, match="no trainable tensors"):
        solver(np.zeros(0), np.zeros(0), np.zeros(0), 10.0)
    with pytest.raises(ConfigError, match="negative"):
        solver(np.array([1.0, -2.0]), np.ones(2), np.ones(2), 10.0)


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_bad_resolution(bad):
    with pytest.raises(ConfigError, match="resolution"):
        select_tensors(np.ones(3), np.ones(3), np.ones(3), 10.0, resolution=bad)


def test_backward_us_many_agrees_with_brute_force_costs():
    rng = np.random.default_rng(1)
    t_dw, t_dy = rng.integers(0, 9, 8), rng.integers(0, 9, 8)
    _, cost, _ = brute_force(t_dw, t_dy, np.zeros(8), 0)
    assert np.allclose(cost, backward_us_many(all_masks(8), t_dw, t_dy))


# ---- strategies: the one "budget, then select" step and the masks of every strategy ----

T_DW = np.array([3.0, 2.0, 50.0, 7.0, 1.0, 4.0])
T_DY = np.array([10.0, 0.0, 4.0, 6.0, 2.0, 0.0])
IMPORTANCE = np.array([0.5, 2.0, 3.0, 1.0, 0.2, 1.5])
PROFILE = SimpleNamespace(
    t_dw_us=T_DW,
    t_dy_us=T_DY,
    forward_us=40.0,
    t_full_us=40.0 + T_DW.sum() + T_DY.sum(),
    measured_full_step_us=1e9,  # never used: the budget is of the time model's T_full
)
SOLVER_OF = {"elastic": select_tensors, "topk": select_topk, "prefix": select_backward_prefix}


@pytest.mark.parametrize("strategy", BUDGETED_STRATEGIES)
@pytest.mark.parametrize("rho", [0.45, 0.6, 0.8, 1.0])
def test_select_for_rho_is_budget_then_select(strategy, rho):
    budget = budget_us(rho, PROFILE.forward_us, PROFILE.t_full_us)
    expected = SOLVER_OF[strategy](T_DW, T_DY, IMPORTANCE, budget)
    got = select_for_rho(PROFILE, rho, IMPORTANCE, strategy=strategy)
    assert got.mask.tolist() == expected.mask.tolist()
    assert got.objective == expected.objective and got.strategy == expected.strategy
    assert got.backward_us <= budget
    step = PROFILE.forward_us + got.backward_us
    assert step <= rho * PROFILE.t_full_us + 1e-9  # paper Eq. 3: T_selective <= rho * T_full


def test_select_for_rho_defaults_and_resolution():
    rho = 0.6
    budget = budget_us(rho, PROFILE.forward_us, PROFILE.t_full_us)
    assert select_for_rho(PROFILE, rho, IMPORTANCE).strategy == "dp"  # elastic by default
    coarse = select_for_rho(PROFILE, rho, IMPORTANCE, resolution=3)
    expected = select_tensors(T_DW, T_DY, IMPORTANCE, budget, resolution=3)
    assert coarse.mask.tolist() == expected.mask.tolist()
    # The prefix needs no importance: without it every tensor scores 1.
    prefix = select_for_rho(PROFILE, rho, None, strategy="prefix")
    assert prefix.objective == prefix.count
    assert prefix.indices.tolist() == list(range(int(prefix.indices[0]), len(T_DW)))


# A coarse model (two tensors): training the last alone runs at 0.8 of the full step, the first
# alone at 0.867, nothing in between.
COARSE = SimpleNamespace(
    t_dw_us=np.array([12.0, 8.0]), t_dy_us=np.zeros(2), forward_us=40.0, t_full_us=60.0
)


def test_rho_tolerance_takes_the_nearer_selection_above_rho():
    imp = np.array([2.0, 1.0])
    strict = select_for_rho(COARSE, 0.85, imp)  # the ceiling: 48 us, 5.9% short of 51 us
    assert strict.indices.tolist() == [1]
    banded = select_for_rho(COARSE, 0.85, imp, tolerance=0.05)  # 52 us: 2.0% over
    assert banded.indices.tolist() == [0]
    assert banded.objective > strict.objective
    # Within the band the ceiling holds: 48 us is 3.6% short of 0.83 * 60 us.
    assert select_for_rho(COARSE, 0.83, imp, tolerance=0.05).indices.tolist() == [1]
    # A band too narrow to reach the next selection changes nothing.
    assert select_for_rho(COARSE, 0.85, imp, tolerance=0.01).indices.tolist() == [1]
    for strategy in ("topk", "prefix"):
        got = select_for_rho(COARSE, 0.85, imp, strategy=strategy, tolerance=0.05)
        assert COARSE.forward_us + got.backward_us <= 0.85 * 1.05 * COARSE.t_full_us
    with pytest.raises(ConfigError, match="rho tolerance must be in"):
        select_for_rho(COARSE, 0.85, imp, tolerance=1.0)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(min_value=0, max_value=2**32 - 1),
    st.integers(min_value=1, max_value=8),
    st.floats(min_value=0.3, max_value=1.0),
    st.floats(min_value=0.0, max_value=0.2),
)
def test_rho_tolerance_never_worse_than_the_ceiling(seed, n, rho, tol):
    rng = np.random.default_rng(seed)
    prof = SimpleNamespace(
        t_dw_us=rng.uniform(0, 30, n).round(1),
        t_dy_us=rng.uniform(0, 30, n).round(1),
        forward_us=float(rng.uniform(5, 40)),
        t_full_us=0.0,
    )
    prof.t_full_us = prof.forward_us + prof.t_dw_us.sum() + prof.t_dy_us.sum()
    imp = rng.uniform(-0.2, 1.0, n)
    try:
        strict = select_for_rho(prof, rho, imp)
    except InfeasibleBudgetError:
        return
    banded = select_for_rho(prof, rho, imp, tolerance=tol)
    target = rho * prof.t_full_us
    step = prof.forward_us + banded.backward_us
    assert step <= min(1.0, rho * (1 + tol)) * prof.t_full_us + 1e-6
    assert abs(step - target) <= abs(prof.forward_us + strict.backward_us - target) + 1e-9
    assert banded.objective >= strict.objective - 1e-9


def test_select_for_rho_errors():
    low = 0.9 * PROFILE.forward_us / PROFILE.t_full_us  # below the forward pass alone
    floor = min_feasible_rho(T_DW, T_DY, PROFILE.forward_us, PROFILE.t_full_us)
    with pytest.raises(InfeasibleBudgetError, match="raise rho to at least") as err:
        select_for_rho(PROFILE, low, IMPORTANCE)
    assert err.value.min_rho == pytest.approx(floor)
    with pytest.raises(InfeasibleBudgetError, match="for the prefix baseline"):
        select_for_rho(PROFILE, floor, None, strategy="prefix")  # needs the last tensor's dy too
    with pytest.raises(ConfigError, match="unknown budgeted strategy 'full'"):
        select_for_rho(PROFILE, 0.5, IMPORTANCE, strategy="full")
    for strategy in ("elastic", "topk"):
        with pytest.raises(ConfigError, match="needs the importance"):
            select_for_rho(PROFILE, 0.5, None, strategy=strategy)
    with pytest.raises(ConfigError, match=r"rho must be in \(0, 1\]"):
        select_for_rho(PROFILE, 1.5, IMPORTANCE)


def _tensors():
    """Six tensors: conv kernel, bn gamma/beta, conv kernel + bias, fc kernel (the last layer)."""
    spec = [
        ("c1.w", "kernel", "conv1"),
        ("bn.g", "gamma", "bn1"),
        ("bn.b", "beta", "bn1"),
        ("c2.w", "kernel", "conv2"),
        ("c2.b", "bias", "conv2"),
        ("fc.w", "kernel", "fc"),
    ]
    return [
        TensorInfo(index=i, name=n, kind=k, layer=layer, op_type="Conv", shape=(1,), params=1)
        for i, (n, k, layer) in enumerate(spec)
    ]


def test_strategy_mask_of_every_strategy():
    tensors = _tensors()
    masks = {s: strategy_mask(s, tensors, PROFILE, 0.6, IMPORTANCE) for s in STRATEGIES}
    assert masks["full"].tolist() == [True] * 6
    assert masks["last-layer"].tolist() == [False] * 5 + [True]
    assert masks["bn-bias"].tolist() == [False, True, True, False, True, True]
    assert masks["bias-only"].tolist() == [False, False, True, False, True, True]  # BitFit
    for strategy in BUDGETED_STRATEGIES:
        expected = select_for_rho(PROFILE, 0.6, IMPORTANCE, strategy=strategy).mask
        assert masks[strategy].tolist() == expected.tolist()
    # The prefix ignores importance; the budget-free strategies ignore rho.
    prefix = strategy_mask("prefix", tensors, PROFILE, 0.6, None)
    assert prefix.tolist() == masks["prefix"].tolist()
    assert strategy_mask("full", tensors, PROFILE, 0.01, None).all()
    for mask in masks.values():
        assert mask.dtype == bool and mask.flags.writeable


def test_strategy_mask_rejects_unknown_strategy():
    with pytest.raises(ConfigError, match="unknown strategy 'best': choose one of elastic"):
        strategy_mask("best", _tensors(), PROFILE, 0.5, IMPORTANCE)
