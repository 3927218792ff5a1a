"""The calculator verifier: which claims it reads, its verdict on a path, and its scores in a search."""

from types import SimpleNamespace

import pytest

from runtime.wire.protocol import Delta, GenerateRequest, SamplingParams, SearchParams
from runtime.verify.scoring import CalculatorScorer
from runtime.verify.verifiers.calculator import CHECKED, REFUTED, UNCHECKED, claims, evaluate, step_score, tier
from runtime.verify.verifiers.confidence import confidence_from_logprobs
from tests.runtime.engine_helpers import engine_for
from tests.runtime.search.test_search_engine import run_search


@pytest.mark.parametrize("text, expected", [
    ("8 + 8 = 10.", [("8 + 8", "10", 16, False)]),
    ("52 + 3 = 55.", [("52 + 3", "55", 55, True)]),
    ("(4 + 2) x 3 = 18", [("(4 + 2) * 3", "18", 18, True)]),
    ("$12 \\times 3 = $36", [("12 * 3", "36", 36, True)]),
    ("24 \\cdot 9 = 216 and 16 ÷ 4 = 5", [("24 * 9", "216", 216, True), ("16 / 4", "5", 4, False)]),
    ("1,000 + 2,500 = 3,500", [("1000 + 2500", "3500", 3500, True)]),
    ("Tom buys 3 more: 5 + 3 = 8. He eats 2: 8 - 2 = 6.", [("5 + 3", "8", 8, True), ("8 - 2", "6", 6, True)]),
    ("9 - 10 = -1", [("9 - 10", "-1", -1, True)]),
    ("14 / 10 = 1", [("14 / 10", "1", 1.4, False)]),  # an integer is stated exactly
    ("10 / 3 = 3.33", [("10 / 3", "3.33", 10 / 3, True)]),  # to the decimals written
    ("10 / 3 = 3.3", [("10 / 3", "3.3", 10 / 3, True)]),
    ("10 / 3 = 3.4", [("10 / 3", "3.4", 10 / 3, False)]),
    # a right side that is an expression is no claim of a number; the next equation is read
    ("3 + 4 = 7 + 1 = 8", [("7 + 1", "8", 8, True)]),
    # not arithmetic the calculator reads: algebra, a power, one number, a word before the number
    ("2x + 3 = 7", []), ("2 ** 3 = 8", []), ("x = 5", []), ("7 = 7", []), ("x2 + 3 = 5", []),
    ("(4 + 2 * 3 = 10", [("(4 + 2 * 3", "10", None, False)]),  # unbalanced: unreadable, left unchecked
])
def test_claims(text, expected):
    assert [(c.expression, c.stated, c.value, c.holds) for c in claims(text)] == expected


def test_evaluate_refuses_what_is_not_arithmetic():
    assert evaluate("2 + 3 * 4") == 14
    assert evaluate("-(2 - 5)") == 3
    for expression in ("1 / 0", "2 ** 3", "abs(2)", "a + 1", "9" * 31 + " + 1", "1 +"):
        assert evaluate(expression) is None, expression


@pytest.mark.parametrize("steps, expected", [
    (["8 + 8 = 16.", "The final answer is $\\boxed{16}$."], CHECKED),
    (["8 + 8 = 10.", "The final answer is $\\boxed{10}$."], REFUTED),  # a false claim refutes the path
    (["5 + 3 = 9.", "9 - 2 = 7.", "The final answer is $\\boxed{7}$."], REFUTED),  # ... whatever follows
    (["21 + 7 = 28.", "The final answer is $\\boxed{21}$."], REFUTED),  # an answer against the last result
    (["28 + 98 = 126.", "The final answer is $98$."], REFUTED),
    (["28 + 98 = 126.", "So, the final answer is 98."], REFUTED),
    (["(4 + 2 * 3 = 10.", "The final answer is 10."], UNCHECKED),  # the unreadable claim is no result
    (["21 + 7 = 28, so the answer is 28."], CHECKED),
    (["The sum is 36.", "The final answer is $\\boxed{36}$."], UNCHECKED),  # nothing to check
    (["8 + 8 = 16.", "The final answer is $\\boxed{\\frac{32}{2}}$."], CHECKED),  # not a number: not compared
    ([], UNCHECKED),
])
def test_tier_of_a_path(steps, expected):
    assert tier(steps) == expected


def test_step_scores_order_by_tier_then_confidence():
    refuted = step_score(["8 + 8 = 10."], 0.99)
    unchecked = step_score(["Eight and eight."], 0.2)
    checked = step_score(["8 + 8 = 16."], 0.1)
    assert refuted == pytest.approx(0.99 / 3) and unchecked == pytest.approx(1.2 / 3)
    assert checked == pytest.approx(2.1 / 3)
    assert refuted < unchecked < checked < step_score(["8 + 8 = 16."], 0.5) <= 1.0


def test_scorer_scores_each_path_from_its_units_and_logprobs():
    heard = []
    controller = SimpleNamespace(on_score=lambda path, score: heard.append((path.name, score)))
    paths = [SimpleNamespace(name="right", chunks=["8 + 8 = 16."], lookahead_units=[], chunk_logprobs=[-0.1, -0.3],
                             lookahead_logprobs=[]),
             SimpleNamespace(name="wrong", chunks=["8 + 8 = 16.", "The final answer is 10."], lookahead_units=[],
                             chunk_logprobs=[-0.5], lookahead_logprobs=[])]
    for path in paths:
        path.scoring_units = (lambda p: lambda: p.chunks + p.lookahead_units)(path)
    CalculatorScorer().submit(controller, paths)
    assert heard == [("right", (2 + confidence_from_logprobs([-0.1, -0.3])) / 3),
                     ("wrong", (0 + confidence_from_logprobs([-0.5])) / 3)]


def _scores(engine, request_id, verifier):
    request = GenerateRequest(
        request_id=request_id, endpoint="chat", messages=({"role": "user", "content": "w1 w2 w3"},),
        sampling=SamplingParams(max_tokens=24, temperature=1.0, seed=5, n=4),
        search=SearchParams(strategy="best_of_n", n=4, max_steps=3, max_step_tokens=6, verifier=verifier))
    deltas = [m for m in run_search(engine, request) if isinstance(m, Delta) and m.search is not None]
    return {d.search.answer: list(d.search.step_scores) for d in deltas}


def test_without_arithmetic_a_search_scores_as_confidence_does_one_tier_up(tiny_llama):
    """Best-of-N samples the same paths whichever verifier scores them; on text with nothing to calculate
    (the tiny model's) every step is unchecked, so each score is (1 + its confidence) / 3."""
    engine = engine_for(tiny_llama, num_blocks=256)
    confident = _scores(engine, "by-confidence", "confidence")
    calculated = _scores(engine, "by-calculator", "calculator")
    assert confident.keys() == calculated.keys() and len(confident) > 1
    for answer, steps in confident.items():
        assert calculated[answer] == pytest.approx([(1 + s) / 3 for s in steps], rel=1e-12)
