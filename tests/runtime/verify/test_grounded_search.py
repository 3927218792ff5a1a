"""The README's first search example (beam, n 8, the calculator), asked the word problem whose answer
once rested on a number from nowhere (`12 - 6 = 6` for 12 pencils less 5), on the embedded model."""

import pytest

from bench.accuracy import messages_for
from runtime.search.aggregate import split_steps
from runtime.verify.verifiers.calculator import claims, normalize
from runtime.verify.verifiers.grounding import is_supported, operands, question_numbers
from runtime.wire.params import SamplingParams, SearchParams
from runtime.wire.protocol import Delta, GenerateRequest
from tests.runtime.search.test_search_engine import run_search

PENCILS = "Sara has 12 pencils and gives away 5. How many pencils does she have left?"


@pytest.fixture(scope="module")
def embedded():
    from runtime.bootstrap import build_engine
    from runtime.model.loader import ModelNotFound
    from runtime.wire.options import RuntimeOptions

    try:
        engine, _ = build_engine(RuntimeOptions(model=None, device="cpu", batch_invariant=True))
    except ModelNotFound as exc:
        pytest.skip(str(exc))
    return engine


def ungrounded(question: str, steps: list[str]) -> list[float]:
    """The operands of the steps' true equations that neither the question nor an earlier result supports."""
    known, missing = set(question_numbers(question)), []
    for step in steps:
        for claim in claims(step):
            known.update(claim.chained)
            missing += [x for x in operands(claim.expression) if not is_supported(x, known)]
            if claim.value is not None:
                known.add(claim.value)
    return missing


@pytest.mark.parametrize("greedy_anchor", [True, False])
def test_the_readme_search_answers_the_pencil_question_without_a_number_from_nowhere(embedded, greedy_anchor):
    request = GenerateRequest(
        request_id=f"pencils-{greedy_anchor}", endpoint="chat", messages=messages_for(PENCILS),
        sampling=SamplingParams(max_tokens=64, temperature=0.8, seed=0),
        search=SearchParams(strategy="beam", n=8, verifier="calculator", max_steps=4, max_step_tokens=32,
                            greedy_anchor=greedy_anchor))
    text = "".join(m.text for m in run_search(embedded, request) if isinstance(m, Delta) and m.index == 0)
    steps = split_steps(text, "\n\n")
    assert any(claims(normalize(step)) for step in steps), text  # it computes something ...
    assert ungrounded(PENCILS, steps) == [], text  # ... and only with numbers it was given or computed
