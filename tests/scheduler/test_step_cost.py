"""The step-cost model: a decode step's fixed and per-row seconds, fitted from measured steps, and the
speculative rows they make worth adding."""

import pytest

from scheduler.step_cost import PRIOR_USEFUL, StepCost


def test_nothing_is_decided_before_steps_of_two_sizes():
    cost = StepCost()
    assert cost.fit() is None and cost.speculative_rows(16) == 0
    for _ in range(10):
        cost.observe(16, 0.04)
    assert cost.fit() is None and cost.speculative_rows(16) == 0  # one batch size cannot tell fixed from a row


def test_fixed_and_per_row_seconds_are_fitted_exactly():
    cost = StepCost()
    for rows in (1, 4, 8, 16, 3, 12):
        cost.observe(rows, 0.020 + 0.002 * rows)
    fixed, per_row = cost.fit()
    assert fixed == pytest.approx(0.020) and per_row == pytest.approx(0.002)
    # useful x (fixed / per_row + rows) = 0.5 x (10 + 6)
    assert cost.useful == PRIOR_USEFUL and cost.speculative_rows(6) == 8
    cost.observe_speculation(saved=30, speculated=100)
    assert cost.speculative_rows(6) == 4  # 0.3 x 16 = 4.8


def test_rows_that_cost_nothing_are_unbounded_and_a_costly_row_gets_none():
    gpu = StepCost()
    for rows in (1, 16, 6, 9, 2):
        gpu.observe(rows, 0.010)
    assert gpu.fit() == (pytest.approx(0.010), 0.0) and gpu.speculative_rows(16) is None
    cpu = StepCost()
    for rows in (1, 2, 3, 4, 5):
        cpu.observe(rows, 0.0001 + 0.010 * rows)
    cpu.observe_speculation(saved=0, speculated=100)
    assert cpu.speculative_rows(4) == 0


def test_older_steps_weigh_less():
    cost = StepCost()
    for rows in (1, 8) * 20:
        cost.observe(rows, 0.010 + 0.010 * rows)  # a slow start
    for rows in (1, 8) * 200:
        cost.observe(rows, 0.020 + 0.001 * rows)
    fixed, per_row = cost.fit()
    assert fixed == pytest.approx(0.020, rel=1e-3) and per_row == pytest.approx(0.001, rel=1e-2)
