"""The engine's search against a plain reference over transformers, and its bookkeeping."""

import pytest

from transformers import AutoModelForCausalLM

from runtime.wire.params import SamplingParams, SearchParams
from runtime.wire.protocol import Delta, Finished, GenerateRequest, RequestError, SearchEvent
from runtime.verify.verifiers.judge import JudgeVerifier
from tests.runtime.engine_helpers import engine_for
from tests.runtime.search.reference import ReferenceSearch

QUESTION = "w1 w2 w3"


def search_request(request_id, **search):
    params = dict(strategy="beam", n=8, beam_width=4, max_steps=4, max_step_tokens=5, verifier="confidence",
                  include_events=True)
    params.update(search)
    return GenerateRequest(request_id=request_id, endpoint="chat", messages=({"role": "user", "content": QUESTION},),
                           sampling=SamplingParams(max_tokens=30, temperature=1.0, seed=11, n=3),
                           search=SearchParams(**params))


def run_search(engine, request):
    out = engine.add_request(request)
    assert not isinstance(out[0], RequestError), out
    messages = []
    while engine.has_work:
        messages += engine.step()
        engine.check_integrity()
    return messages


def engine_choices(messages, request_id=None):
    texts, scores = {}, {}
    for m in messages:
        if isinstance(m, Delta) and (request_id is None or m.request_id == request_id):
            texts[m.index] = texts.get(m.index, "") + m.text
            if m.search is not None:
                scores[m.index] = (m.search.score, list(m.search.step_scores))
    return [(texts[i], *scores[i]) for i in sorted(scores)]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return engine_for(tiny_llama, num_blocks=1024)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


@pytest.mark.parametrize("strategy, verifier, granularity, select, lookahead", [
    ("beam", "confidence", 1, "best", 0),
    ("beam", "judge", 1, "best", 0),
    ("best_of_n", "confidence", 1, "weighted_majority", 0),
    ("dvts", "confidence", 1, "best", 0),
    ("dynamic_branching", "judge", 1, "majority", 0),
    ("beam", "confidence", 2, "best", 0),
    ("beam", "judge", 1, "best", 1),
    ("dvts", "confidence", 1, "best", 2),
])
def test_engine_search_selects_what_the_reference_selects(engine, hf, strategy, verifier, granularity, select,
                                                          lookahead):
    # The reference is the strategies alone: no greedy anchor (tests/runtime/search/test_search_anchor.py).
    request = search_request(f"{strategy}-{verifier}-{granularity}-{lookahead}", strategy=strategy,
                             verifier=verifier, granularity=granularity, select=select, lookahead=lookahead,
                             greedy_anchor=False)
    messages = run_search(engine, request)
    prompt_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        list(request.messages), add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    judge = JudgeVerifier(hf, engine.tokenizer) if verifier == "judge" else None
    reference = ReferenceSearch(hf, engine.tokenizer, prompt_ids, QUESTION, request.search, 1.0, 11, 30,
                                engine.eos_ids, judge).run(3)
    ours = engine_choices(messages)
    assert [t for t, _, _ in ours] == [t for t, _, _ in reference]
    for (_, score, steps), (_, ref_score, ref_steps) in zip(ours, reference):
        assert score == pytest.approx(ref_score, rel=1e-4, abs=1e-5)
        assert steps == pytest.approx(ref_steps, rel=1e-4, abs=1e-5)
    assert engine.pool.num_used == 0
    engine.pool.check_integrity([])


@pytest.mark.parametrize("strategy", ["beam", "particle_filtering"])
def test_committed_stream_concatenates_to_the_winner_and_events_are_sent(engine, strategy):
    messages = run_search(engine, search_request(f"stream-{strategy}", n=4, beam_width=2, max_steps=5,
                                                 strategy=strategy))
    deltas = [m for m in messages if isinstance(m, Delta) and m.index == 0]
    final = [d for d in deltas if d.finish_reason][0]
    assert "".join(d.text for d in deltas) == engine_choices(messages)[0][0]
    assert deltas[-1] is final
    events = [m for m in messages if isinstance(m, SearchEvent)]
    assert [e.step for e in events][:3] == [1, 2, 3]
    finished = messages[-1]
    assert isinstance(finished, Finished)
    s = finished.search
    assert s.strategy == strategy and s.steps >= 1 and s.paths_explored >= 4
    assert s.tokens_generated >= s.tokens_returned > 0
    assert finished.completion_tokens == s.tokens_returned


def test_judge_queries_reuse_the_prefix_cache(engine):
    messages = run_search(engine, search_request("judge-cache", verifier="judge", n=4, beam_width=2))
    s = messages[-1].search
    assert s.verifier_calls >= 2
    assert s.prefix_hit_tokens > 0  # later questions find the problem and earlier steps cached
    assert s.verifier_tokens_prefilled > 0


@pytest.mark.parametrize("strategy", ["beam", "particle_filtering"])
def test_abort_mid_search_frees_every_block(engine, strategy):
    engine.add_request(search_request("abort", n=8, max_steps=10, strategy=strategy))
    for _ in range(6):
        engine.step()
    assert engine.pool.num_used > 0
    engine.abort("abort")
    assert engine.pool.num_used == 0 and not engine.has_work
    engine.check_integrity()


@pytest.mark.parametrize("search, fragment", [
    (dict(verifier="no-such"), "unknown verifier"),
    (dict(strategy="dvts", n=6, beam_width=4), "multiple"),
    (dict(answer_pattern="(unclosed"), "search"),
])
def test_bad_search_requests_are_refused(engine, search, fragment):
    out = engine.add_request(search_request("bad", **search))
    assert isinstance(out[0], RequestError) and out[0].status == 400
    assert fragment in out[0].message or fragment == out[0].param
    assert not engine.has_work


def test_search_is_independent_of_other_traffic(engine):
    alone = engine_choices(run_search(engine, search_request("alone", n=4, beam_width=2)))
    engine.add_request(GenerateRequest(request_id="other", endpoint="completion", prompt_token_ids=(1, 5, 6, 7),
                                       sampling=SamplingParams(max_tokens=20, temperature=0.9, seed=2)))
    mixed = engine_choices(run_search(engine, search_request("mixed", n=4, beam_width=2)), "mixed")
    assert alone == mixed  # the same tokens and scores, to the bit



def test_memory_pressure_mid_search_preempts_and_keeps_the_result(tiny_llama):
    roomy = engine_for(tiny_llama, num_blocks=1024)
    tight = engine_for(tiny_llama, num_blocks=16)  # 64 tokens for 8 paths: parked paths give up blocks
    request = dict(n=8, beam_width=4, max_steps=4)
    expected = engine_choices(run_search(roomy, search_request("roomy", **request)))
    got = engine_choices(run_search(tight, search_request("tight", **request)))
    assert got == expected  # recomputed tokens get the KV they had: the same bits
    assert tight.stats["preemptions"] > 0 and roomy.stats["preemptions"] == 0


def test_a_verifier_sequence_larger_than_the_pool_fails_only_its_request(tiny_llama):
    small = engine_for(tiny_llama, num_blocks=14)  # the judge's question outgrows 56 tokens of KV
    out = small.add_request(search_request("too-big", verifier="judge", n=4, beam_width=2, max_steps=6))
    assert not isinstance(out[0], RequestError)
    messages = []
    while small.has_work:
        messages += small.step()
    errors = [m for m in messages if isinstance(m, RequestError)]
    assert len(errors) == 1 and errors[0].status == 503 and errors[0].code == "kv_cache_exhausted"
    assert small.pool.num_used == 0 and not small.searches
    small.check_integrity()
