"""Time model (paper Eq. 3, inclusive f(M)): etgraph.timing."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etgraph.errors import ConfigError, InfeasibleBudgetError
from etgraph.selection import select_tensors
from etgraph.timing import (
    BranchCharges,
    backward_us,
    backward_us_many,
    budget_us,
    earliest_selected,
    min_feasible_backward_us,
    min_feasible_rho,
    single_tensor_costs_us,
    step_us,
)

T_DW = np.array([10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0])
T_DY = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0])


def test_paper_worked_example():
    # Paper §2.2 / issue: M = [0,0,0,1,1,0,0] gives f(M) = [0,0,0,1,1,1,1].
    mask = np.array([0, 0, 0, 1, 1, 0, 0], dtype=bool)
    assert earliest_selected(mask) == 3
    f_m = np.arange(7) >= earliest_selected(mask)
    assert f_m.astype(int).tolist() == [0, 0, 0, 1, 1, 1, 1]
    expected = (40 + 50) + (8 + 16 + 32 + 64)
    assert backward_us(mask, T_DW, T_DY) == expected
    assert step_us(mask, T_DW, T_DY, forward_us=500.0) == 500.0 + expected


def test_earliest_selected_is_inclusive_of_its_own_t_dy():
    one = np.zeros(7, dtype=bool)
    one[6] = True
    assert backward_us(one, T_DW, T_DY) == 70 + 64  # the output tensor pays its own t_dy
    one[:] = False
    one[0] = True
    assert backward_us(one, T_DW, T_DY) == 10 + T_DY.sum()


def test_empty_and_full_masks():
    empty = np.zeros(7, dtype=bool)
    assert earliest_selected(empty) is None
    assert backward_us(empty, T_DW, T_DY) == 0.0
    assert step_us(empty, T_DW, T_DY, forward_us=123.0) == 123.0
    full = np.ones(7, dtype=bool)
    assert backward_us(full, T_DW, T_DY) == T_DW.sum() + T_DY.sum()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_backward_us_many_matches_scalar(data):
    n = data.draw(st.integers(1, 10))
    t_dw = np.array(data.draw(st.lists(st.integers(0, 50), min_size=n, max_size=n)), float)
    t_dy = np.array(data.draw(st.lists(st.integers(0, 50), min_size=n, max_size=n)), float)
    k = data.draw(st.integers(1, 8))
    masks = np.array(
        data.draw(st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=k, max_size=k))
    )
    many = backward_us_many(masks, t_dw, t_dy)
    assert many.shape == (k,)
    for row, value in zip(masks, many, strict=True):
        # Definition, written out independently of the implementation.
        e = np.flatnonzero(row)
        direct = 0.0 if e.size == 0 else t_dw[row].sum() + t_dy[e[0] :].sum()
        assert value == pytest.approx(direct)
        assert backward_us(row, t_dw, t_dy) == pytest.approx(direct)


def test_budget_us_and_rho_validation():
    assert budget_us(0.5, forward_us=100.0, t_full_us=1000.0) == pytest.approx(400.0)
    assert budget_us(1.0, forward_us=100.0, t_full_us=1000.0) == pytest.approx(900.0)
    assert budget_us(0.05, forward_us=100.0, t_full_us=1000.0) == pytest.approx(-50.0)
    for bad in (0.0, -0.1, 1.01, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="rho"):
            budget_us(bad, forward_us=100.0, t_full_us=1000.0)
    with pytest.raises(ConfigError, match="t_full_us must be positive"):
        budget_us(0.5, forward_us=100.0, t_full_us=0.0)
    with pytest.raises(ConfigError, match="t_full_us must be positive"):
        min_feasible_rho(T_DW, T_DY, 100.0, 0.0)


def test_min_feasible_rho_is_the_boundary():
    forward = 300.0
    full = forward + T_DW.sum() + T_DY.sum()
    costs = single_tensor_costs_us(T_DW, T_DY)
    assert costs.tolist() == [T_DW[k] + T_DY[k:].sum() for k in range(7)]
    cheapest, k = min_feasible_backward_us(T_DW, T_DY)
    assert (cheapest, k) == (134.0, 6)
    rho = min_feasible_rho(T_DW, T_DY, forward, full)
    assert rho == pytest.approx((forward + 134.0) / full)
    sel = select_tensors(T_DW, T_DY, np.ones(7), budget_us(rho, forward, full))
    assert sel.count >= 1
    with pytest.raises(InfeasibleBudgetError, match="raise rho to at least") as err:
        select_tensors(
            T_DW,
            T_DY,
            np.ones(7),
            budget_us(rho * 0.999, forward, full),
            forward_us=forward,
            t_full_us=full,
        )
    assert err.value.min_rho == pytest.approx(rho)


def test_min_feasible_rho_picks_a_cheap_early_tensor():
    # An early tensor can be cheaper than the output tensor when t_dy is tiny and t_dw huge late.
    t_dw = np.array([1.0, 1.0, 1000.0])
    t_dy = np.array([0.0, 0.0, 5.0])
    assert min_feasible_backward_us(t_dw, t_dy) == (6.0, 0)
    assert min_feasible_rho(t_dw, t_dy, 10.0, 100.0) == pytest.approx(0.16)


def test_invalid_inputs():
    with pytest.raises(ConfigError, match="same length"):
        backward_us(np.ones(3, bool), np.ones(3), np.ones(4))
    with pytest.raises(ConfigError, match="negative"):
        backward_us(np.ones(2, bool), np.array([1.0, -1.0]), np.ones(2))
    with pytest.raises(ConfigError, match="NaN"):
        backward_us(np.ones(2, bool), np.array([1.0, np.nan]), np.ones(2))
    with pytest.raises(ConfigError, match="mask"):
        backward_us(np.ones(3, bool), np.ones(2), np.ones(2))
    with pytest.raises(ConfigError, match="no trainable tensors"):
        min_feasible_rho(np.zeros(0), np.zeros(0), 1.0, 2.0)


def test_selection_and_timing_are_pure_numpy():
    # The selector runs inside the training loop: it must not drag in ONNX Runtime or torch.
    code = (
        "import sys, etgraph.selection, etgraph.timing; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'onnxruntime', 'torch', 'onnx'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_branch_charges_count_branch_work_only_where_it_runs():
    """Tensors 0 | 1 2 (shortcut) | 3 4 (main branch) | 5: an op of the main branch has
    D = {0, 3, 4} (p = 1, extra {3, 4}) and sits in t_dy[4]; the chain counts it for any
    e <= 4, but it runs only if tensor 0, 3 or 4 trains."""
    t_dw = np.zeros(6)
    t_dy = np.array([0.0, 0.0, 0.0, 0.0, 100.0, 1.0])
    branches = BranchCharges.from_rows(
        [{"tensor": 4, "prefix": 1, "extra": [3, 4], "us": 100.0}], 6
    )

    def exact(selected):
        mask = np.zeros(6, dtype=bool)
        mask[selected] = True
        return backward_us(mask, t_dw, t_dy, branches), backward_us(mask, t_dw, t_dy)

    assert exact([1]) == (1.0, 101.0)  # shortcut only: main-branch op skipped
    assert exact([2, 5]) == (1.0, 101.0)
    assert exact([1, 3]) == (101.0, 101.0)  # a main-branch tensor trains
    assert exact([0]) == (101.0, 101.0)  # before the branch point
    assert exact([5]) == (1.0, 1.0)  # after the block: neither counts it
    assert exact([]) == (0.0, 0.0)
    masks = np.array([[0, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=bool)
    np.testing.assert_allclose(backward_us_many(masks, t_dw, t_dy, branches), [1.0, 101.0])
    with pytest.raises(ConfigError, match="bad tensor indices"):
        BranchCharges.from_rows([{"tensor": 9, "prefix": 1, "extra": [3], "us": 1.0}], 6)
    with pytest.raises(ConfigError, match="malformed branch charges"):
        BranchCharges.from_rows([{"tensor": 1, "prefix": 1, "extra": [30], "us": 1.0}], 6)
