"""Echo and prompt logprobs (what lm-evaluation-harness's loglikelihood tasks send), checked against a
transformers forward pass over the same tokens: in the engine (chunked prefill, the prefix cache) and
through the HTTP API (/v1/completions echo + logprobs, vLLM's prompt_logprobs)."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.protocol import Delta, Finished
from tests.runtime.engine_helpers import engine_for, request, run
from tests.server.live import live_server

TOL = 1e-4
PROMPT = [1] + list(range(4, 34))  # 31 tokens: 8 blocks of 4, over several chunks of 8


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama).eval(), AutoTokenizer.from_pretrained(tiny_llama)


def reference(model, ids: list[int]) -> torch.Tensor:
    """log-softmax over the vocabulary at every position, `[len(ids), vocab]`."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def drain(engine, req) -> list:
    engine.add_request(req)
    messages = []
    while engine.has_work:
        messages += engine.step()
        engine.check_integrity()
    return messages


def check_prompt_logprobs(prompt_logprobs, ids, ref, k):
    assert [p.token_id for p in prompt_logprobs] == ids
    assert prompt_logprobs[0].logprob is None and prompt_logprobs[0].rank is None and prompt_logprobs[0].top == ()
    for position in range(1, len(ids)):
        p = prompt_logprobs[position]
        row = ref[position - 1]
        assert abs(p.logprob - row[ids[position]].item()) < TOL
        assert p.rank == int((row > row[ids[position]]).sum()) + 1
        values, top_ids = torch.topk(row, k)
        assert [t.token_id for t in p.top] == top_ids.tolist()
        assert [t.rank for t in p.top] == list(range(1, k + 1))
        assert max(abs(t.logprob - v) for t, v in zip(p.top, values.tolist())) < TOL


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_engine_prompt_logprobs_match_transformers_chunked_and_after_the_prefix_cache(tiny_llama, hf,
                                                                                      batch_invariant):
    model, _ = hf
    ref = reference(model, PROMPT)
    engine = engine_for(tiny_llama, max_num_batched_tokens=8, batch_invariant=batch_invariant)
    plain = run(engine, [request("warm", PROMPT, max_tokens=2)])  # fills the prefix cache with the prompt
    assert plain["warm"]["finished"].prompt_tokens == len(PROMPT)
    hits = engine.kv.prefix_stats.hit_tokens
    for attempt in range(2):  # the prompt's blocks are cached both times
        messages = drain(engine, request(f"score{attempt}", PROMPT, max_tokens=2, prompt_logprobs=3, echo=True))
        deltas = [m for m in messages if isinstance(m, Delta)]
        check_prompt_logprobs(deltas[0].prompt_logprobs, PROMPT, ref, 3)
        assert all(d.prompt_logprobs is None for d in deltas[1:])
        assert deltas[0].prompt_text == engine.tokenizer.decode(PROMPT)
        finished = [m for m in messages if isinstance(m, Finished)][0]
        assert finished.cached_tokens == 0  # the prompt was recomputed, not read from the cache
        # The generated tokens are what the request gives without prompt logprobs.
        assert [t for d in deltas for t in d.token_ids] == plain["warm"]["choices"][0]
    assert engine.kv.prefix_stats.hit_tokens == hits  # no hit was counted for the recomputed prompts


def test_engine_max_tokens_zero_scores_the_prompt_alone(tiny_llama, hf):
    model, _ = hf
    ids = PROMPT[:10]
    engine = engine_for(tiny_llama)
    messages = drain(engine, request("zero", ids, max_tokens=0, prompt_logprobs=1, echo=True, n=2))
    deltas = sorted((m for m in messages if isinstance(m, Delta)), key=lambda d: d.index)
    assert [(d.index, d.text, d.token_ids, d.finish_reason) for d in deltas] == [(0, "", (), "length"),
                                                                                (1, "", (), "length")]
    for d in deltas:
        check_prompt_logprobs(d.prompt_logprobs, ids, reference(model, ids), 1)
    finished = [m for m in messages if isinstance(m, Finished)][0]
    assert (finished.prompt_tokens, finished.completion_tokens) == (10, 0)
    assert engine.pool.num_used == 0


def test_engine_without_prompt_logprobs_keeps_no_prompt_rows(tiny_llama):
    engine = engine_for(tiny_llama)
    calls = []
    execute = engine.runner.execute
    engine.runner.execute = lambda *args: calls.append(args[3:]) or execute(*args)
    messages = drain(engine, request("plain", PROMPT, max_tokens=2))
    assert calls and all(not extra[0] for extra in calls)  # no prompt rows kept
    assert all(m.prompt_logprobs is None and m.prompt_text is None for m in messages if isinstance(m, Delta))
