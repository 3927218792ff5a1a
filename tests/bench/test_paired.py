"""The accuracy benchmark's paired statistics, checked against examples worked by hand."""

from __future__ import annotations

import itertools
import math

import pytest

from bench import paired
from bench.paired import Paired


def test_exact_mcnemar_by_hand():
    """b = 4, c = 14: 18 discordant pairs, min(b, c) = 4, so
    sum_{k<=4} C(18, k) = 1 + 18 + 153 + 816 + 3060 = 4048 and p = 2 * 4048 / 2^18 = 8096 / 262144
    = 0.0308837890625 exactly."""
    assert paired.mcnemar_exact(4, 14) == 8096 / 262144
    assert round(paired.mcnemar_exact(14, 4), 4) == 0.0309
    assert paired.mcnemar_exact(0, 0) == 1.0  # no discordant pair: no evidence
    assert paired.mcnemar_exact(5, 5) == 1.0  # 2 * P(X <= 5) > 1 is capped
    assert paired.mcnemar_exact(0, 5) == 2 / 32  # 2 * C(5, 0) / 2^5
    with pytest.raises(ValueError):
        paired.mcnemar_exact(-1, 3)


def test_newcombe_interval_by_hand():
    """a = 20, b = 4, c = 14, d = 22 (n = 60), z = 1.959964, z^2 = 3.841459.
    p1 = 24/60 = 0.4, Wilson: centre (0.4 + z^2/120) / (1 + z^2/60) = 0.432012 / 1.064024 = 0.406017,
      half z sqrt(0.4 * 0.6 / 60 + z^2 / 14400) / 1.064024 = 1.959964 * 0.065321 / 1.064024 = 0.120324,
      so (l1, u1) = (0.285695, 0.526340).
    p2 = 34/60 = 0.566667, likewise (l2, u2) = (0.441034, 0.684276).
    ad - bc = 440 - 56 = 384 > n/2, corrected to 384 - 30 = 354; sqrt(24 * 36 * 34 * 26) = 873.9428,
      phi = 354 / 873.9428 = 0.405060.
    lower = -0.166667 - sqrt(0.114305^2 - 2 phi 0.114305 * 0.117609 + 0.117609^2) = -0.166667 - 0.126520
          = -0.293187;
    upper = -0.166667 + sqrt(0.126339^2 - 2 phi 0.126339 * 0.125632 + 0.125632^2) = -0.166667 + 0.137429
          = -0.029238."""
    low, high = paired.newcombe_interval(20, 4, 14, 22)
    assert (round(low, 4), round(high, 4)) == (-0.2932, -0.0292)
    both = Paired(20, 4, 14, 22)
    assert both.difference == pytest.approx(-10 / 60)
    assert both.as_dict() == {"difference": -0.1667, "ci95": [-0.2932, -0.0292], "p_value": 0.0309,
                              "discordant": [4, 14], "verdict": "significantly worse"}
    assert paired.sentence("best_of_n:confidence N=4", "greedy", both) == (
        "best_of_n:confidence N=4 vs greedy: -16.7 points [-29.3, -2.9], p = 0.03, significantly worse")


def test_newcombe_interval_keeps_inside_bounds_and_width_without_discordance():
    low, high = paired.newcombe_interval(0, 0, 0, 10)  # both always wrong: no difference, yet not a point
    assert low < 0 < high and -1 <= low and high <= 1
    low, high = paired.newcombe_interval(0, 10, 0, 0)  # the method always right, the baseline never
    assert high == 1.0 and 0.5 < low < 1.0
    assert paired.newcombe_interval(0, 0, 0, 0) == (-1.0, 1.0)


def test_paired_counts_come_from_outcomes_problem_by_problem():
    method = [True, True, False, False, True]
    baseline = [True, False, True, False, False]
    assert Paired.of(method, baseline) == Paired(1, 2, 1, 1)
    assert Paired(1, 2, 1, 1).verdict() == "not significant"
    with pytest.raises(ValueError, match="same problems"):
        Paired.of([True], [True, False])


def test_connor_sample_size_by_hand():
    """delta = 0.10, psi = 0.20, z_0.975 = 1.959964, z_0.80 = 0.841621:
    (1.959964 * sqrt(0.2) + 0.841621 * sqrt(0.2 - 0.01))^2 / 0.01 = (0.876523 + 0.366854)^2 / 0.01
    = 1.243377^2 / 0.01 = 154.6 -> 155."""
    assert paired.problems_needed(0.10, 0.20) == 155
    assert [paired.problems_needed(0.10, psi) for psi in (0.15, 0.25, 0.30)] == [116, 194, 234]
    with pytest.raises(ValueError):
        paired.problems_needed(0.10, 0.05)  # the discordance must exceed the difference


def test_exact_power_equals_enumerating_every_table():
    """For 12 problems, sum over every (b, c, rest) the multinomial probability of the tables the exact
    test rejects at 0.05."""
    n, psi, delta = 12, 0.5, 0.3
    pb, pc = (psi + delta) / 2, (psi - delta) / 2
    expected = 0.0
    for b, c in itertools.product(range(n + 1), repeat=2):
        if b + c <= n and paired.mcnemar_exact(b, c) < 0.05:
            ways = math.factorial(n) // (math.factorial(b) * math.factorial(c) * math.factorial(n - b - c))
            expected += ways * pb**b * pc**c * (1 - psi) ** (n - b - c)
    assert paired.exact_power(n, delta, psi) == pytest.approx(expected, rel=1e-12)


def test_the_exact_test_needs_a_little_more_than_connor():
    table = paired.power_table((0.20,))
    assert table[0]["connor"] == 155 and table[0]["exact_power_at_connor"] < 0.8
    exact = table[0]["exact"]
    assert exact > 155
    assert all(paired.exact_power(m, 0.10, 0.20) >= 0.8 for m in range(exact, exact + 40))
    assert paired.exact_power(exact - 1, 0.10, 0.20) < 0.8


def _row(label, method, n, tokens, right):
    return {"label": label, "method": method, "n": n, "tokens_generated": tokens,
            "statuses": ["correct" if r else "wrong" for r in right]}


def test_every_method_meets_greedy_and_the_majority_nearest_in_tokens():
    greedy = _row("greedy", "greedy", 1, 30, [1, 0, 0, 0, 1, 0])
    vote4 = _row("majority", "majority", 4, 120, [1, 1, 0, 0, 1, 0])
    vote16 = _row("majority", "majority", 16, 480, [1, 1, 1, 0, 1, 0])
    best4 = _row("best_of_n:confidence", "best_of_n", 4, 118, [1, 1, 1, 1, 1, 0])
    beam4 = _row("beam:judge", "beam", 4, 260, [0, 0, 0, 0, 0, 0])  # 260/120 = 2.17, 480/260 = 1.85
    compared = paired.comparisons([greedy, vote4, vote16, best4, beam4])
    assert [(c["label"], c["n"]) for c in compared] == [
        ("majority", 4), ("majority", 16), ("best_of_n:confidence", 4), ("beam:judge", 4)]
    assert "vs_majority" not in compared[0] and compared[0]["vs_greedy"]["discordant"] == [1, 0]
    assert compared[2]["vs_majority"]["baseline"] == "majority N=4"
    assert compared[2]["vs_majority"]["token_ratio"] == 0.98
    assert compared[2]["vs_majority"]["discordant"] == [2, 0]
    assert compared[2]["vs_greedy"]["discordant"] == [3, 0]
    assert compared[3]["vs_majority"]["baseline"] == "majority N=16"  # nearer on a log scale
    assert compared[3]["vs_majority"]["discordant"] == [0, 4]
    lines = paired.comparison_lines(compared)
    assert lines[-1] == "no difference is significant at 0.05"  # six problems prove nothing


def test_a_significant_difference_is_said_in_words():
    """a = 0, b = 0, c = 14, d = 6: p2 = 0.7 in (0.4810, 0.8545), p1 = 0 in (0, 0.1611), phi = 0 (a margin is 0):
    lower = -0.7 - (0.8545 - 0.7) = -0.8545, upper = -0.7 + sqrt(0.1611^2 + (0.7 - 0.4810)^2) = -0.4281;
    p = 2 / 2^14 = 0.00012."""
    greedy = _row("greedy", "greedy", 1, 30, [1] * 14 + [0] * 6)
    beam = _row("beam:judge", "beam", 4, 200, [0] * 14 + [0] * 6)
    lines = paired.comparison_lines(paired.comparisons([greedy, beam]))
    assert lines[-2:] == ["significant at 0.05:",
                          "  beam:judge N=4 vs greedy: -70.0 points [-85.5, -42.8], p < 0.001, significantly worse"]


def test_a_pilot_names_the_levels_where_greedy_is_right_20_to_70_percent():
    greedy = _row("greedy", "greedy", 1, 30, [1, 1, 0, 0, 1, 0, 0, 0, 0, 0])
    greedy["by_level"] = {"1": 1.0, "2": 0.5, "3": 0.2, "4": 0.0, "5": 0.0}
    vote = _row("majority", "majority", 4, 120, [1, 0, 1, 1, 1, 0, 0, 0, 0, 0])
    rows = [greedy, vote]
    advice = paired.pilot_advice({"results": rows, "comparisons": paired.comparisons(rows)})
    assert advice["levels_in_band"] == [2, 3]
    assert advice["rows"] == [{"label": "majority", "n": 4, "discordance": 0.3,
                               "problems_needed": paired.problems_needed(0.10, 0.3)}]
