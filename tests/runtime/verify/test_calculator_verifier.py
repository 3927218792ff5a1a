"""The calculator verifier: which claims it reads, its verdict on a path, and its scores in a search."""

from types import SimpleNamespace

import pytest

from runtime.wire.params import SamplingParams, SearchParams
from runtime.wire.protocol import Delta, GenerateRequest
from runtime.verify.scoring import CalculatorScorer
from runtime.verify.verifiers.calculator import (
    CHECKED, REFUTED, UNCHECKED, UNSUPPORTED, claims, evaluate, step_score, tier,
)
from runtime.verify.verifiers.grounding import question_numbers
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
    ("3 + 4 = 7 + 1 = 8", [("7 + 1", "8", 8, True)]),  # (3 + 4 is its chained left side: test below)
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


def test_a_chain_hands_its_left_side_to_the_next_claim():
    assert [c.chained for c in claims("3 + 4 = 7 + 1 = 8")] == [(7,)]
    assert [c.chained for c in claims("3 + 4 = 7. 7 + 1 = 8")] == [(), ()]


# Every operand of the paths below is in this question, so grounding passes and the arithmetic decides.
GROUNDS = "8 + 8, 5 + 3 - 2, 9 - 2, 21 + 7, 28 + 98, 4 + 2 * 3"


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
    assert tier(steps, GROUNDS) == expected


PENCILS = "Sara has 12 pencils and gives away 5. How many pencils does she have left?"


@pytest.mark.parametrize("question, steps, expected", [
    # The search's answer in the issue: true equations, one over a 6 from nowhere.
    (PENCILS, ["Sara has 12 pencils: 12 x 5 = 60.", "She has 12 - 6 = 6 remaining pencils.",
               "The final answer is $\\boxed{6}$."], UNSUPPORTED),
    (PENCILS, ["Sara has 12 pencils: 12 x 5 = 60."], CHECKED),  # grounded so far (the wrong operation is)
    (PENCILS, ["Sara has 12 pencils: 12 x 5 = 60.", "She has 12 - 6 = 6 remaining pencils."], UNSUPPORTED),
    (PENCILS, ["She gives away 5: 12 - 5 = 7.", "The final answer is $\\boxed{7}$."], CHECKED),
    (PENCILS, ["12 - 5 = 7.", "7 + 0 = 7.", "The final answer is $\\boxed{7}$."], UNSUPPORTED),  # 0 from nowhere
    (PENCILS, ["12 - 5 = 7.", "7 - 5 = 2.", "The final answer is 2."], CHECKED),  # a result is reused
    (PENCILS, ["12 - 5 = 7.", "The final answer is $\\boxed{60}$."], REFUTED),  # not the last result
    (PENCILS, ["12 - 5 = 8."], REFUTED),  # false beats unsupported and grounded
    (PENCILS, ["She has 3 + 4 = 7 + 0 = 7 pencils."], UNSUPPORTED),  # 3 and 4 are nowhere
    # number words, and the constants units imply
    ("Ben has twelve apples and eats three.", ["12 - 3 = 9."], CHECKED),
    ("Ben has twenty-five apples and eats a dozen.", ["25 - 12 = 13."], CHECKED),
    ("Ben has twenty five apples.", ["25 - 12 = 13."], UNSUPPORTED),  # no dozen here
    ("A film lasts 2 hours. How many minutes is that?", ["2 x 60 = 120."], CHECKED),
    ("A film lasts 2 hours.", ["2 x 60 = 120."], UNSUPPORTED),  # minutes are not asked about
    ("Mia reads 3 pages a day for 2 weeks.", ["2 x 7 = 14.", "14 x 3 = 42."], CHECKED),
    ("Half of the 30 cookies are eaten.", ["30 / 2 = 15."], CHECKED),
    ("A pen costs $1.50. How much do 4 pens cost?", ["$1.50 x 4 = $6.", "The answer is 6."], CHECKED),
    ("Dan has 1,200 stamps and sells 200.", ["1,200 - 200 = 1,000."], CHECKED),
    ("Dan has 3 + 4 = 7 + 1 stamps.", ["3 + 4 = 7 + 1 = 8."], CHECKED),  # a chain's left side is a result
    ("", ["8 + 8 = 16."], UNSUPPORTED),  # no question grounds nothing
])
def test_grounding(question, steps, expected):
    assert tier(steps, question) == expected


def test_question_numbers():
    assert question_numbers("Ava has two hundred and one marbles, twice as many as Ben; 25% are red.") == {
        2.0, 200.0, 100.0, 1.0, 25.0}
    assert question_numbers("Four dozen eggs, half a pair.") == {4.0, 12.0, 2.0, 0.5}


def test_step_scores_order_by_tier_then_confidence():
    question = "What is 8 + 8?"
    refuted = step_score(["8 + 8 = 10."], 0.99, question)
    unsupported = step_score(["8 + 9 = 17."], 0.99, question)
    unchecked = step_score(["Eight and eight."], 0.2, question)
    checked = step_score(["8 + 8 = 16."], 0.1, question)
    assert refuted == pytest.approx(0.99 / 4) and unsupported == pytest.approx(1.99 / 4)
    assert unchecked == pytest.approx(2.2 / 4) and checked == pytest.approx(3.1 / 4)
    assert refuted < unsupported < unchecked < checked < step_score(["8 + 8 = 16."], 0.5, question) <= 1.0


def test_scorer_scores_each_path_from_its_units_and_logprobs():
    heard = []
    controller = SimpleNamespace(on_score=lambda path, score: heard.append((path.name, score)),
                                 question="What is 8 + 8?")
    paths = [SimpleNamespace(name="right", chunks=["8 + 8 = 16."], lookahead_units=[], chunk_logprobs=[-0.1, -0.3],
                             lookahead_logprobs=[]),
             SimpleNamespace(name="wrong", chunks=["8 + 8 = 16.", "The final answer is 10."], lookahead_units=[],
                             chunk_logprobs=[-0.5], lookahead_logprobs=[])]
    for path in paths:
        path.scoring_units = (lambda p: lambda: p.chunks + p.lookahead_units)(path)
    CalculatorScorer(tokenizer=None).submit(controller, paths)  # the question is text: nothing to decode
    assert heard == [("right", (3 + confidence_from_logprobs([-0.1, -0.3])) / 4),
                     ("wrong", (0 + confidence_from_logprobs([-0.5])) / 4)]


def _scores(engine, request_id, verifier):
    request = GenerateRequest(
        request_id=request_id, endpoint="chat", messages=({"role": "user", "content": "w1 w2 w3"},),
        sampling=SamplingParams(max_tokens=24, temperature=1.0, seed=5, n=4),
        search=SearchParams(strategy="best_of_n", n=4, max_steps=3, max_step_tokens=6, verifier=verifier))
    deltas = [m for m in run_search(engine, request) if isinstance(m, Delta) and m.search is not None]
    return {d.search.answer: list(d.search.step_scores) for d in deltas}


def test_without_arithmetic_a_search_scores_as_confidence_does_one_tier_up(tiny_llama):
    """Best-of-N samples the same paths whichever verifier scores them; on text with nothing to calculate
    (the tiny model's) every step is unchecked, so each score is (2 + its confidence) / 4."""
    engine = engine_for(tiny_llama, num_blocks=256)
    confident = _scores(engine, "by-confidence", "confidence")
    calculated = _scores(engine, "by-calculator", "calculator")
    assert confident.keys() == calculated.keys() and len(confident) > 1
    for answer, steps in confident.items():
        assert calculated[answer] == pytest.approx([(2 + s) / 4 for s in steps], rel=1e-12)


def test_a_prompt_given_as_token_ids_grounds_in_its_decoded_text():
    decoded = []
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: decoded.append(ids) or "What is 8 + 8?")
    heard = []
    controller = SimpleNamespace(on_score=lambda path, score: heard.append(score), question="", prompt_ids=[5, 6])
    path = SimpleNamespace(chunks=["8 + 8 = 16."], lookahead_units=[], chunk_logprobs=[-0.2], lookahead_logprobs=[],
                           scoring_units=lambda: ["8 + 8 = 16."])
    CalculatorScorer(tokenizer).submit(controller, [path])
    assert decoded == [[5, 6]] and heard == [(3 + confidence_from_logprobs([-0.2])) / 4]
