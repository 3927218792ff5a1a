import math

import pytest

from runtime.search.aggregate import aggregate, allocate_children, normalize_step, refill, split_steps


@pytest.mark.parametrize("mode, expected", [
    ("last", 0.5), ("min", 0.2), ("prod", 0.8 * 0.2 * 0.5), ("mean", 0.5),
])
def test_aggregation_modes(mode, expected):
    assert aggregate([0.8, 0.2, 0.5], mode) == pytest.approx(expected, abs=1e-15)


def test_aggregation_errors():
    with pytest.raises(ValueError, match="no step scores"):
        aggregate([], "last")
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate([0.1], "max")


def test_allocation_is_proportional_to_shifted_scores():
    # w = [0.4, 0.1, 0, 0.5] + 1e-6, sum 1.000004; shares of 8 = [3.199995, 0.800002, 0.000008,
    # 3.999992]: floors [3, 0, 0, 3], leftover 2 to the largest fractions, index 3 then index 1
    counts = allocate_children([0.9, 0.6, 0.5, 1.0], 8)
    assert counts == [3, 1, 0, 4]


def test_allocation_exact_floors_and_leftovers():
    # w = [0, 1, 2] + 1e-6: shares of 10 = [0.000003, 3.333332, 6.666664]
    scores = [1.0, 2.0, 3.0]
    w = [s - 1.0 + 1e-6 for s in scores]
    shares = [10 * x / sum(w) for x in w]
    floors = [math.floor(s) for s in shares]
    assert floors == [0, 3, 6]
    # leftover 1 to the largest fractional part: 3.3333 (0.333) vs 0.0000017 vs 6.666 (0.666)
    assert allocate_children(scores, 10) == [0, 3, 7]


def test_allocation_ties_go_to_the_lower_index():
    assert allocate_children([0.5, 0.5, 0.5], 4) == [2, 1, 1]
    assert allocate_children([0.7, 0.7, 0.7, 0.7], 2) == [1, 1, 0, 0]
    assert allocate_children([0.3], 5) == [5]


def test_allocation_sums_to_n():
    scores = [0.13, 0.87, 0.55, 0.02, 0.91, 0.4, 0.66]
    for n in range(0, 40):
        counts = allocate_children(scores, n)
        assert sum(counts) == n and all(c >= 0 for c in counts)


def test_allocation_errors():
    assert allocate_children([], 0) == []
    with pytest.raises(ValueError):
        allocate_children([], 3)
    with pytest.raises(ValueError):
        allocate_children([0.1, float("nan")], 3)
    with pytest.raises(ValueError):
        allocate_children([0.1], -1)


def test_refill_duplicates_cyclically():
    assert refill(["a", "b", "c"], 8) == ["a", "b", "c", "a", "b", "c", "a", "b"]
    assert refill(["a", "b", "c"], 3) == ["a", "b", "c"]
    assert refill(["a", "b", "c"], 2) == ["a", "b"]
    assert refill([7], 3) == [7, 7, 7]
    assert refill([], 0) == []
    with pytest.raises(ValueError):
        refill([], 2)


def test_normalize_step_strips_trailing_delimiters():
    assert normalize_step("x = 2.\n\n", "\n\n") == "x = 2."
    assert normalize_step("x = 2.\n\n\n\n\n", "\n\n") == "x = 2."
    assert normalize_step("x = 2.\n\nmore", "\n\n") == "x = 2.\n\nmore"
    assert normalize_step("a ## ##", " ##") == "a"
    assert normalize_step("a ##  ", " ##") == "a ##  "  # non-whitespace delimiter: spaces stay
    assert normalize_step("abc", "") == "abc"


def test_split_steps_drops_empty_steps():
    assert split_steps("one\n\ntwo\n\n", "\n\n") == ["one", "two"]
    assert split_steps("one\n\n\n\ntwo", "\n\n") == ["one", "two"]
    assert split_steps("\n\n", "\n\n") == []
    assert split_steps("only", "\n\n") == ["only"]
