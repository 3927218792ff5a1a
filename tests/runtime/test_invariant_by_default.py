"""With default settings the same seed gives the same tokens and scores: a search cold, with its prompt
and the judge's questions in the prefix cache, beside other traffic, and under another policy and pool
size; and the same for plain sampling with n > 1."""

import pytest

from runtime.bootstrap import build_engine
from runtime.wire.params import SamplingParams, SearchParams
from runtime.wire.protocol import Delta, Finished, GenerateRequest
from server.config import Settings
from tests.runtime.engine_helpers import request
from tests.runtime.search.test_search_engine import engine_choices, run_search

# Long enough to fill several 16-token blocks, so a second run finds whole blocks cached.
QUESTION = " ".join(f"w{i % 7} + {i % 5} ки" for i in range(24))
SEARCH = dict(strategy="beam", n=6, beam_width=3, max_steps=3, max_step_tokens=6, verifier="judge")


def default_engine(model, **sections):
    """An engine as `ponder serve --model MODEL` builds it, but for the given sections."""
    options = Settings.load(None, model={"path": str(model), "device": "cpu"}, **sections).runtime_options()
    assert options.batch_invariant == "auto"
    engine, _ = build_engine(options)
    assert engine.padding is not None  # auto, and this CPU computes each row on its own
    return engine


def search(request_id, seed=7):
    return GenerateRequest(request_id=request_id, endpoint="chat", messages=({"role": "user", "content": QUESTION},),
                           sampling=SamplingParams(max_tokens=18, temperature=1.0, seed=seed, n=2),
                           search=SearchParams(**SEARCH))


def traffic(tag):
    """Plain requests beside the search: greedy, seeded and unseeded sampling, a long prompt."""
    return [request(f"{tag}-greedy", list(range(5, 60)), max_tokens=9),
            request(f"{tag}-sampled", [3, 4, 5, 6], max_tokens=12, temperature=0.9, seed=3, n=3),
            request(f"{tag}-unseeded", list(range(7, 30)), max_tokens=7, temperature=1.0),
            request(f"{tag}-long", [9] * 200, max_tokens=5)]


def sampled(engine, requests, request_id):
    """Run `requests` together; (token ids, log-probabilities) of each choice of `request_id`."""
    for req in requests:
        engine.add_request(req)
    choices = {}
    while engine.has_work:
        for m in engine.step():
            if isinstance(m, Delta) and m.request_id == request_id:
                ids, logprobs = choices.setdefault(m.index, ([], []))
                ids.extend(m.token_ids)
                logprobs.extend(entry.logprob for entry in m.logprobs or ())
        engine.check_integrity()
    return choices


@pytest.fixture(scope="module")
def cold(tiny_llama):
    engine = default_engine(tiny_llama)
    return engine, engine_choices(run_search(engine, search("cold")))


def test_a_seeded_search_is_the_same_cached_as_cold(cold):
    engine, expected = cold
    messages = run_search(engine, search("cached"))
    assert next(m for m in messages if isinstance(m, Finished)).cached_tokens >= 32  # the prompt's blocks
    assert engine_choices(messages) == expected
    assert len(expected) == 2 and all(text for text, _, _ in expected)


def test_a_seeded_search_is_the_same_beside_other_traffic(tiny_llama, cold):
    _, expected = cold
    engine = default_engine(tiny_llama, scheduler={"max_num_batched_tokens": 64})  # long prompts in chunks
    for req in traffic("before"):
        engine.add_request(req)
    engine.step()  # the search joins steps already under way
    messages = run_search(engine, search("busy"))
    assert engine_choices(messages, "busy") == expected
    assert engine_choices(messages, "before-sampled") == [] and \
        any(getattr(m, "request_id", None) == "before-sampled" for m in messages)  # it shared the steps


@pytest.mark.parametrize("sections", [
    {"scheduler": {"policy": "token"}, "cache": {"num_blocks": 40}},
    {"scheduler": {"policy": "lbs_no_prefix"}, "cache": {"num_blocks": 40}},
    {"cache": {"num_blocks": 40, "enable_prefix_cache": False}},
])
def test_a_seeded_search_is_the_same_under_another_policy_and_pool(tiny_llama, cold, sections):
    _, expected = cold
    assert engine_choices(run_search(default_engine(tiny_llama, **sections), search("other"))) == expected


def test_plain_sampling_with_n_is_the_same_alone_cached_and_beside_traffic(tiny_llama):
    prompt = list(range(11, 50))
    params = dict(max_tokens=10, temperature=0.8, seed=5, n=4, logprobs=True)
    alone = sampled(default_engine(tiny_llama), [request("alone", prompt, **params)], "alone")
    engine = default_engine(tiny_llama, scheduler={"max_num_batched_tokens": 32})
    first = sampled(engine, [*traffic("t1"), request("first", prompt, **params)], "first")
    second = sampled(engine, [request("second", prompt, **params), *traffic("t2")], "second")
    assert len(alone) == 4 and all(len(ids) == len(logprobs) == 10 for ids, logprobs in alone.values())
    assert first == alone and second == alone
