import subprocess
import sys
from pathlib import Path

import pytest

from runtime.search.answers import (
    Candidate,
    answers_equivalent,
    compile_answer_pattern,
    extract_answer,
    group_answers,
    select,
)

# ---------------------------------------------------------------------------------------------
# Extraction


@pytest.mark.parametrize("text, expected", [
    # 1. the `final answer is $...$` span wins over everything else, a box inside it is unwrapped
    ("so \\boxed{3}. Therefore, the final answer is: $\\boxed{\\frac{1}{2}}$. I hope it is correct.",
     "\\frac{1}{2}"),
    ("The final answer is $x^2 + 1$.", "x^2 + 1"),
    ("first the final answer is $1$, no wait, the final answer is $2$", "2"),
    # 2. the last brace-balanced box, nested braces kept whole
    ("\\boxed{1} then \\boxed{\\frac{\\sqrt{2}}{2}} done", "\\frac{\\sqrt{2}}{2}"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\boxed{\\left\\{ a \\right\\}}", "\\left\\{ a \\right\\}"),
    ("a complete \\boxed{7} and a truncated \\boxed{\\frac{1}{", "7"),
    ("\\fbox{9}", "9"),
    # 3. the rest of the line after the last "the answer is"
    ("Adding up, the answer is 42.\nI am sure.", "42"),
    ("The answer is: $\\frac{3}{4}$.", "\\frac{3}{4}"),
    # 4. the last number, thousands separators removed
    ("We get 3 apples and then 1,250.5 pears", "1250.5"),
    ("the temperature drops to -4", "-4"),
    ("points (1, 2) and .5", ".5"),
])
def test_extraction_order(text, expected):
    assert extract_answer(text) == expected


def test_no_answer():
    assert extract_answer("no digits here at all") is None
    assert extract_answer("") is None


def test_custom_pattern_takes_the_last_match_and_its_first_group():
    text = "ANSWER: B\nhmm, actually\nANSWER: C"
    assert extract_answer(text, r"ANSWER: (\w)") == "C"
    assert extract_answer(text, r"ANSWER: \w") == "ANSWER: C"  # no group: the whole match
    assert extract_answer(text, compile_answer_pattern(r"(?:ANSWER): (\w)")) == "C"
    assert extract_answer(text, r"FINAL: (\w)") is None
    # a custom pattern replaces the built-in rules entirely
    assert extract_answer("\\boxed{5}", r"ANSWER: (\w)") is None
    # an optional group that did not take part means no answer
    assert extract_answer("ANSWER:", r"ANSWER:( \w)?") is None


def test_invalid_custom_pattern_is_a_value_error():
    with pytest.raises(ValueError, match="answer_pattern"):
        compile_answer_pattern("(unclosed")


# ---------------------------------------------------------------------------------------------
# Equivalence


@pytest.mark.parametrize("a, b", [
    ("\\frac{1}{2}", "0.5"), ("2", "2.0"), ("\\dfrac{3}{4}", "3/4"), ("1,000", "1000"),
    ("\\{1, 2\\}", "\\{2, 1\\}"), (" 7 ", "7"),
])
def test_math_verify_equivalence(a, b):
    assert answers_equivalent(a, b)
    assert answers_equivalent(b, a)


@pytest.mark.parametrize("a, b", [("\\frac{1}{2}", "0.6"), ("2", "3"), ("x", "y"), ("\\pi", "3.14")])
def test_math_verify_difference(a, b):
    assert not answers_equivalent(a, b)


def test_unparseable_answers_compare_as_text():
    assert answers_equivalent("\\unknownmacro{{", "\\unknownmacro{{")
    assert not answers_equivalent("\\unknownmacro{{", "\\unknownmacro{")


def test_custom_pattern_answers_compare_as_plain_strings():
    assert not answers_equivalent("0.5", "\\frac{1}{2}", compare_as_text=True)
    assert not answers_equivalent("2", "2.0", compare_as_text=True)
    assert answers_equivalent("B ", "B", compare_as_text=True)


# ---------------------------------------------------------------------------------------------
# Selection


def cands(*pairs):
    return [Candidate(answer, score) for answer, score in pairs]


def test_best_ranks_by_score_then_index():
    candidates = cands(("1", 0.2), ("2", 0.9), ("3", 0.5), ("4", 0.9), (None, 0.95))
    assert select(candidates, "best") == [4, 1, 3, 2, 0]


def test_majority_ranks_groups_by_size():
    # answers: 0.5 (three ways of writing it), 7 (twice), 3 (once, best single score), none
    candidates = cands(("\\frac{1}{2}", 0.1), ("7", 0.6), ("0.5", 0.3), ("3", 0.99),
                       ("7.0", 0.5), ("1/2", 0.2), (None, 0.98))
    assert group_answers(candidates) == [[0, 2, 5], [1, 4], [3], [6]]
    # group {0.5}: size 3; {7}: size 2; {3}: size 1 best 0.99; {none}: size 1 best 0.98
    assert select(candidates, "majority") == [2, 5, 0, 1, 4, 3, 6]


def test_majority_ties_go_to_the_group_with_the_best_score():
    candidates = cands(("1", 0.4), ("2", 0.8), ("1", 0.5), ("2", 0.1))
    assert select(candidates, "majority") == [1, 3, 2, 0]
    # equal best scores too: the group whose best member has the lower index
    candidates = cands(("1", 0.1), ("2", 0.7), ("1", 0.7), ("2", 0.1))
    assert select(candidates, "majority") == [1, 3, 2, 0]


def test_weighted_majority_sums_scores_per_group():
    # "5": 0.3 + 0.3 + 0.3 = 0.9 (largest group), "6": 0.95 alone, "8": 0.5 + 0.45 = 0.95, tie with
    # "6" broken by the best member (0.95 of "6" beats 0.5 of "8")
    candidates = cands(("5", 0.3), ("6", 0.95), ("5", 0.3), ("8", 0.5), ("5", 0.3), ("8", 0.45))
    assert select(candidates, "weighted_majority") == [1, 3, 5, 0, 2, 4]
    assert select(candidates, "majority") == [0, 2, 4, 3, 5, 1]
    assert select(candidates, "best") == [1, 3, 5, 0, 2, 4]


def test_weighted_majority_can_beat_the_single_best():
    candidates = cands(("1", 0.9), ("2", 0.6), ("2", 0.6))
    assert select(candidates, "weighted_majority") == [1, 2, 0]
    assert select(candidates, "best") == [0, 1, 2]


def test_candidates_without_answers_never_group_together():
    candidates = cands((None, 0.5), (None, 0.4), ("3", 0.1))
    assert group_answers(candidates) == [[0], [1], [2]]
    assert select(candidates, "majority") == [0, 1, 2]
    assert select(candidates, "weighted_majority") == [0, 1, 2]


def test_custom_pattern_selection_groups_by_text():
    candidates = cands(("0.5", 0.4), ("\\frac{1}{2}", 0.3), ("0.5", 0.2))
    assert select(candidates, "majority", compare_as_text=True) == [0, 2, 1]
    assert select(candidates, "majority") == [0, 1, 2]


def test_nan_scores_rank_last():
    candidates = cands(("1", float("nan")), ("2", 0.1))
    assert select(candidates, "best") == [1, 0]


def test_select_edge_cases():
    assert select([], "majority") == []
    with pytest.raises(ValueError, match="unknown selection"):
        select(cands(("1", 1.0)), "vote")


def test_each_distinct_answer_is_compared_with_the_leaders_once(monkeypatch):
    from runtime.search import answers

    calls = []
    real = answers.answers_equivalent

    def counting(a, b, **kwargs):
        calls.append((a, b))
        return real(a, b, **kwargs)

    monkeypatch.setattr(answers, "answers_equivalent", counting)
    candidates = cands(("7", 0.1), ("0.5", 0.2), ("7", 0.3), (" 7 ", 0.4), ("1/2", 0.5), ("0.5", 0.6),
                       ("7.0", 0.7), (None, 0.8), ("1/2", 0.9))
    assert group_answers(candidates) == [[0, 2, 3, 6], [1, 4, 5, 8], [7]]
    # "7", "0.5", "1/2" and "7.0" against the leaders before them; repeats ask nothing
    assert calls == [("7", "0.5"), ("7", "1/2"), ("0.5", "1/2"), ("7", "7.0")]


def test_integers_are_compared_without_math_verify_and_as_it_would(monkeypatch):
    from runtime.search import answers

    integers = ["0", "7", "-7", "51", "52", "100", "1000000", "1000001", "123456789", "123456788"]
    pairs = [(a, b) for a in integers for b in integers if a != b]
    slow = {pair: answers_equivalent(*pair) for pair in pairs}
    assert not any(slow.values())  # what math-verify says of distinct integers
    monkeypatch.setattr(answers, "_parse", lambda answer: pytest.fail(f"parsed {answer!r}"))
    assert {pair: answers_equivalent(*pair) for pair in pairs} == slow
    # not canonical: a sign on zero, leading zeros, decimals still go to math-verify
    for a, b in [("-0", "0"), ("051", "51"), ("51", "51.0")]:
        with pytest.raises(pytest.fail.Exception):
            answers_equivalent(a, b)


def test_warm_up_loads_the_parser_before_the_first_search():
    # A fresh interpreter: math-verify is not loaded until an answer needs it, and warm_up loads it.
    code = ("import sys; from runtime.search import answers; assert 'math_verify' not in sys.modules; "
            "answers.warm_up(); assert 'math_verify' in sys.modules; assert answers._parse.cache_info().currsize == 2")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3])
