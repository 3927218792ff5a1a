"""Given responses scored through the engine (`RewardRequest`, POST /v1/rewards' runtime half) get the
very scores a search gives the same steps, from the same scorers."""

import pytest

from runtime.wire.protocol import RequestError, RewardCandidate, Rewarded, RewardRequest
from tests.runtime.engine_helpers import engine_for
from tests.runtime.search.test_search_engine import QUESTION, run_search, search_request


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return engine_for(tiny_llama, num_blocks=1024)


def score(engine, request: RewardRequest):
    out = engine.add_rewards(request)
    while engine.has_work:
        out += engine.step()
        engine.check_integrity()
    (answer,) = [m for m in out if m.request_id == request.request_id]
    return answer


def rewards_request(request_id, candidates, verifier, **fields):
    return RewardRequest(request_id=request_id, verifier=verifier, messages=({"role": "user", "content": QUESTION},),
                         candidates=tuple(RewardCandidate(steps=tuple(steps)) for steps in candidates), **fields)


@pytest.mark.parametrize("strategy", ["beam", "best_of_n"])
def test_the_judge_scores_given_steps_as_it_scored_them_in_a_search(engine, monkeypatch, strategy):
    finished = []
    monkeypatch.setattr(engine, "search_finished",
                        lambda controller, done=engine.search_finished: (finished.append(controller), done(controller)))
    run_search(engine, search_request(f"judged-{strategy}", strategy=strategy, verifier="judge", n=4, beam_width=2,
                                      greedy_anchor=False))
    (controller,) = finished
    paths = [p for p in controller.final if p.chunks and len(p.step_scores) == len(p.chunks)]
    assert paths
    answer = score(engine, rewards_request(f"rewards-{strategy}", [p.chunks for p in paths], "judge",
                                           aggregation="min"))
    assert isinstance(answer, Rewarded), answer
    assert [list(r.steps) for r in answer.rewards] == [p.chunks for p in paths]
    assert [list(r.step_scores) for r in answer.rewards] == [p.step_scores for p in paths]  # to the bit
    assert [r.score for r in answer.rewards] == [min(p.step_scores) for p in paths]
    assert answer.input_tokens > answer.cached_tokens > 0  # step k's question found step k-1's cached
    assert engine.pool.num_used == 0 and not engine.rewards and not engine.scoring


def test_a_text_is_cut_at_the_delimiter_as_a_finished_answer_is(engine):
    request = RewardRequest(request_id="cut", verifier="judge", prompt=QUESTION, step_delimiter="w9",
                            candidates=(RewardCandidate(text="w1 w2w9w9 w3 w9"),))
    assert score(engine, request).rewards[0].steps == ("w1 w2", " w3 ")


@pytest.mark.parametrize("candidate, fields, param", [
    (RewardCandidate(steps=(), param="steps"), {}, "steps"),
    (RewardCandidate(steps=("w1", "  "), param="steps"), {}, "steps"),
    (RewardCandidate(text="\n\n\n\n", param="messages"), {}, "messages"),
    (RewardCandidate(steps=("w1",) * 5, param="input.0.steps"), {"max_steps": 4}, "input.0.steps"),
    (RewardCandidate(steps=("w1 w2 w3 " * 200,), param="response"), {}, "response"),
    (RewardCandidate(steps=("w1",)), {"verifier": "oracle"}, "verifier"),
    # They rank by the log-probabilities of tokens the generator sampled: given text has none.
    (RewardCandidate(steps=("w1",)), {"verifier": "confidence"}, "verifier"),
    (RewardCandidate(steps=("w1",)), {"verifier": "calculator"}, "verifier"),
])
def test_bad_reward_requests_are_400s_naming_the_field(engine, candidate, fields, param):
    request = RewardRequest(request_id="bad", verifier=fields.pop("verifier", "judge"), prompt=QUESTION,
                            candidates=(candidate,), **fields)
    (error,) = engine.add_rewards(request)
    assert isinstance(error, RequestError) and error.status == 400 and error.param == param, error
    assert not engine.has_work and not engine.rewards


def test_abort_mid_scoring_frees_every_block(engine):
    engine.add_rewards(rewards_request("gone", [["w1 w2", "w3 w4", "w5"]] * 3, "judge"))
    engine.step()
    engine.abort("gone")
    assert not engine.rewards and not engine.scoring and engine.pool.num_used == 0 and not engine.has_work
