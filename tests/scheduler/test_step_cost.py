"""The step-cost model: a decode step's fixed and per-row seconds, fitted from measured steps, and the
verdict on speculative rows they give."""

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


def test_rows_pay_where_a_saved_step_is_worth_more_than_the_rows_that_saved_it():
    # a GPU-like step: a row costs a 200th of the step's fixed part
    gpu = StepCost()
    for rows in (1, 4, 8, 16, 3, 12):
        gpu.observe(rows, 0.020 + 0.0001 * rows)
    assert gpu.useful == PRIOR_USEFUL
    assert gpu.pays(6) and gpu.speculative_rows(6) is None  # 0.02 x (200 + 6) = 4.1 >= 1
    # a search's first group saves nothing yet: the prior's weight keeps the verdict
    gpu.observe_speculation(saved=0, speculated=6_000)
    assert gpu.useful == pytest.approx(400 / 26_000) and gpu.speculative_rows(6) is None  # 0.0154 x 206 = 3.2
    # measured to save nothing over many tokens: declined
    gpu.observe_speculation(saved=0, speculated=100_000)
    assert gpu.useful == pytest.approx(400 / 126_000) and gpu.speculative_rows(6) == 0  # 0.0032 x 206 = 0.65
    # a CPU-like step: a row costs a tenth of the fixed part, so the prior declines from the start
    cpu = StepCost()
    for rows in (1, 4, 8, 16, 3, 12):
        cpu.observe(rows, 0.004 + 0.0004 * rows)
    assert not cpu.pays(7) and cpu.speculative_rows(7) == 0  # 0.02 x (10 + 7) = 0.34
    # rows that save a step for every 10 tokens pay even there
    cpu.observe_speculation(saved=10_000, speculated=100_000)
    assert cpu.useful == pytest.approx(10_400 / 120_000) and cpu.speculative_rows(7) is None  # 0.087 x 17 = 1.5


def test_rows_that_cost_nothing_are_unbounded_and_a_costly_row_gets_none():
    gpu = StepCost()
    for rows in (1, 16, 6, 9, 2):
        gpu.observe(rows, 0.010)
    assert gpu.fit() == (pytest.approx(0.010), 0.0) and gpu.speculative_rows(16) is None
    cpu = StepCost()
    for rows in (1, 2, 3, 4, 5):
        cpu.observe(rows, 0.0001 + 0.010 * rows)
    assert cpu.speculative_rows(4) == 0


def test_older_steps_weigh_less():
    cost = StepCost()
    for rows in (1, 8) * 20:
        cost.observe(rows, 0.010 + 0.010 * rows)  # a slow start
    for rows in (1, 8) * 200:
        cost.observe(rows, 0.020 + 0.001 * rows)
    fixed, per_row = cost.fit()
    assert fixed == pytest.approx(0.020, rel=1e-3) and per_row == pytest.approx(0.001, rel=1e-2)
