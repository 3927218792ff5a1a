"""A search past its timeout ends the step it is in, verifies it, and answers with the best path so far."""

import types

import pytest

from runtime.wire.params import SamplingParams, SearchParams
from runtime.wire.protocol import Delta, Finished, GenerateRequest, RequestError
from runtime.search import deadline as deadline_module
from tests.runtime.engine_helpers import engine_for

MESSAGES = ({"role": "user", "content": "w1 w2 w3"},)


def request(request_id: str, timeout_s: float | None, strategy: str = "beam") -> GenerateRequest:
    search = SearchParams(strategy=strategy, n=4, beam_width=2, max_steps=8, max_step_tokens=3, verifier="confidence",
                          timeout_s=timeout_s)
    return GenerateRequest(request_id=request_id, endpoint="chat", messages=MESSAGES, search=search,
                           sampling=SamplingParams(max_tokens=40, temperature=1.0, seed=4, ignore_eos=True))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(deadline_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    return clock


def run(engine, req, clock: Clock, jump_after_step: int | None):
    """Step the engine; once the search has verified `jump_after_step` steps and decoded a token of the
    next, move the clock an hour on."""
    assert not isinstance(engine.add_request(req)[0], RequestError)
    messages = []
    while engine.has_work:
        search = engine.searches.get(req.request_id)
        if (jump_after_step is not None and search is not None and search.step_index == jump_after_step
                and search.generating):
            clock.now += 3600
        messages += engine.step()
        engine.check_integrity()
    deltas = [m for m in messages if isinstance(m, Delta) and m.finish_reason is not None]
    (finished,) = [m for m in messages if isinstance(m, Finished)]
    return deltas, finished.search


@pytest.mark.parametrize("strategy", ["beam", "particle_filtering"])
def test_a_search_that_runs_out_of_time_answers_with_its_best_path(tiny_llama, clock, strategy):
    engine = engine_for(tiny_llama, num_blocks=1024)
    _, full = run(engine, request("full", timeout_s=60, strategy=strategy), clock, jump_after_step=None)
    assert full.steps == 8 and full.timed_out is False
    deltas, summary = run(engine, request("cut", timeout_s=60, strategy=strategy), clock, jump_after_step=2)
    # The third step ends at the token after the deadline, is verified, and the search ends there.
    assert summary.steps == 3 and summary.timed_out is True
    assert [d.finish_reason for d in deltas] == ["length"]
    assert len(deltas[0].search.step_scores) == 3
    assert summary.tokens_generated < full.tokens_generated
    assert engine.searches == {}


def test_no_timeout_means_none(tiny_llama, clock):
    engine = engine_for(tiny_llama, num_blocks=1024)
    clock.now += 10**9
    _, summary = run(engine, request("untimed", timeout_s=None), clock, jump_after_step=None)
    assert summary.steps == 8 and summary.timed_out is False


def judged(request_id: str, timeout_s: float) -> GenerateRequest:
    search = SearchParams(strategy="beam", n=4, beam_width=2, max_steps=8, max_step_tokens=3, verifier="judge",
                          timeout_s=timeout_s)
    return GenerateRequest(request_id=request_id, endpoint="chat", messages=MESSAGES, search=search,
                           sampling=SamplingParams(max_tokens=40, temperature=1.0, seed=4, ignore_eos=True))


def finish(engine, req_id: str, messages: list):
    while engine.has_work:
        messages += engine.step()
        engine.check_integrity()
    deltas = [m for m in messages if isinstance(m, Delta) and m.finish_reason is not None]
    (finished,) = [m for m in messages if isinstance(m, Finished)]
    assert engine.searches == {} and engine.scoring == {}
    return deltas, finished.search


def test_past_the_deadline_a_models_verification_is_not_started(tiny_llama, clock):
    """The step cut short is not judged: the answer is chosen by the scores of the steps judged in full."""
    engine = engine_for(tiny_llama, num_blocks=1024)
    deltas, summary = run(engine, judged("cut", timeout_s=60), clock, jump_after_step=2)
    assert summary.steps == 3 and summary.timed_out is True and summary.cut_step_verified is False
    assert len(deltas[0].search.step_scores) == 2
    assert summary.verifier_calls == 2


def test_a_verification_running_at_the_deadline_is_abandoned(tiny_llama, clock):
    engine = engine_for(tiny_llama, num_blocks=1024)
    req = judged("late", timeout_s=60)
    assert not isinstance(engine.add_request(req)[0], RequestError)
    messages = []
    while True:  # until the third step's judge questions are under way
        messages += engine.step()
        search = engine.searches[req.request_id]
        if search.step_index == 3 and search.verification.is_pending:
            break
    clock.now += 3600
    before = len(messages)
    messages += engine.step()  # the next step answers: no question is computed any more
    assert any(isinstance(m, Finished) for m in messages[before:])
    deltas, summary = finish(engine, req.request_id, messages)
    assert summary.steps == 3 and summary.timed_out is True and summary.cut_step_verified is False
    assert len(deltas[0].search.step_scores) == 2  # the third step's scores, if any arrived, taken back


def test_the_confidence_verifier_still_scores_the_cut_step(tiny_llama, clock):
    engine = engine_for(tiny_llama, num_blocks=1024)
    deltas, summary = run(engine, request("free", timeout_s=60), clock, jump_after_step=2)
    assert summary.timed_out is True and summary.cut_step_verified is True
    assert len(deltas[0].search.step_scores) == 3


def test_no_deadline_reports_no_cut_step(tiny_llama, clock):
    engine = engine_for(tiny_llama, num_blocks=1024)
    _, summary = run(engine, judged("whole", timeout_s=60), clock, jump_after_step=None)
    assert summary.timed_out is False and summary.cut_step_verified is None


def test_a_deadline_before_the_first_verification_reports_no_score(tiny_llama, clock):
    """No step was verified: the paths rank as unscored and the answer says so with a null score
    (a float infinity is not JSON)."""
    engine = engine_for(tiny_llama, num_blocks=1024)
    deltas, summary = run(engine, judged("first", timeout_s=60), clock, jump_after_step=0)
    assert summary.steps == 1 and summary.timed_out is True and summary.cut_step_verified is False
    assert deltas[0].search.score is None and deltas[0].search.step_scores == ()
