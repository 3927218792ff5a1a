"""Echo and prompt logprobs (what lm-evaluation-harness's loglikelihood tasks send), checked against a
transformers forward pass over the same tokens: in the engine (chunked prefill, the prefix cache) and
through the HTTP API (/v1/completions echo + logprobs, vLLM's prompt_logprobs)."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.wire.protocol import Delta, Finished
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


# -- through the HTTP API -----------------------------------------------------------------------

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = " ".join(f"w{i}" for i in range(22))  # 23 tokens with <s>: cached blocks of 4 on the second request


@pytest.fixture(scope="module")
def server(tiny_llama):
    with live_server("--model", str(tiny_llama), "--api-key", KEY, "--device", "cpu",
                     env={"PONDER_CACHE__NUM_BLOCKS": "256", "PONDER_CACHE__BLOCK_SIZE": "4",
                          "PONDER_SCHEDULER__MAX_NUM_BATCHED_TOKENS": "16"}, timeout=600) as (base, _):
        yield base


def complete(server, **body) -> dict:
    r = httpx.post(server + "/v1/completions", json={"temperature": 0, **body}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def check_echo(choice, ids, tok, ref, k):
    """OpenAI's echoed logprobs over the prompt `ids`, against the reference log-softmax `ref`."""
    logprobs = choice["logprobs"]
    n = len(ids)
    assert logprobs["tokens"][:n] == [tok.decode([t]) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position in range(1, n):
        row = ref[position - 1]
        assert abs(logprobs["token_logprobs"][position] - row[ids[position]].item()) < TOL
        top = logprobs["top_logprobs"][position]
        best_value, best_id = torch.topk(row, k)
        expected = {tok.decode([t]): v for t, v in zip(best_id.tolist(), best_value.tolist())}
        expected[tok.decode([ids[position]])] = row[ids[position]].item()
        assert top.keys() == expected.keys()
        assert max(abs(top[t] - v) for t, v in expected.items()) < TOL
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs["tokens"]))


def test_echo_with_logprobs_as_lm_eval_sends_it(server, hf):
    model, tok = hf
    ids = tok.encode(TEXT)
    for attempt in range(2):  # the second time the prompt's first blocks are in the prefix cache
        body = complete(server, prompt=TEXT, echo=True, logprobs=1, max_tokens=1)
        choice = body["choices"][0]
        generated = choice["logprobs"]["tokens"][len(ids):]
        assert len(generated) == 1 and choice["text"] == TEXT + generated[0]
        ref = reference(model, ids + [tok.convert_tokens_to_ids(generated[0])])
        check_echo(choice, ids, tok, ref, 1)
        assert abs(choice["logprobs"]["token_logprobs"][-1] - ref[len(ids) - 1].max().item()) < TOL  # greedy
        assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 1
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_max_tokens_zero_scores_the_prompt_alone(server, hf):
    model, tok = hf
    ids = tok.encode(TEXT)
    body = complete(server, prompt=[TEXT, "w3 w4"], echo=True, logprobs=2, max_tokens=0)
    assert [c["text"] for c in body["choices"]] == [TEXT, "w3 w4"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    check_echo(body["choices"][0], ids, tok, reference(model, ids), 2)
    assert len(body["choices"][0]["logprobs"]["tokens"]) == len(ids)
    assert body["usage"]["completion_tokens"] == 0
    # Token-id prompts echo their decoded text.
    body = complete(server, prompt=ids, echo=True, max_tokens=0)
    assert body["choices"][0]["text"] == tok.decode(ids) and body["choices"][0]["logprobs"] is None


def test_vllm_prompt_logprobs_on_completions_and_chat(server, hf):
    model, tok = hf
    ids = tok.encode(TEXT)
    ref = reference(model, ids)

    def check(field):
        assert field[0] is None and len(field) == len(ids)
        for position in range(1, len(ids)):
            row = ref[position - 1]
            entries = field[position]
            top_ids = torch.topk(row, 2).indices.tolist()
            assert set(entries) == {str(t) for t in top_ids + [ids[position]]}
            for token_id, entry in entries.items():
                assert abs(entry["logprob"] - row[int(token_id)].item()) < TOL
                assert entry["rank"] == int((row > row[int(token_id)]).sum()) + 1
                assert entry["decoded_token"] == tok.decode([int(token_id)])

    body = complete(server, prompt=TEXT, max_tokens=2, prompt_logprobs=2)
    check(body["choices"][0]["prompt_logprobs"])
    assert body["choices"][0]["logprobs"] is None and not body["choices"][0]["text"].startswith("w0")

    messages = [{"role": "user", "content": TEXT}]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    ref = reference(model, ids)
    r = httpx.post(server + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"messages": messages, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    check(r.json()["prompt_logprobs"])


def sse(server, path, body) -> list[dict]:
    import json

    chunks = []
    with httpx.stream("POST", server + path, json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_streamed_echo_starts_with_the_prompt(server, hf):
    model, tok = hf
    ids = tok.encode(TEXT)
    chunks = sse(server, "/v1/completions", {"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 3,
                                             "temperature": 0, "stream": True, "ignore_eos": True})
    whole = complete(server, prompt=TEXT, echo=True, logprobs=1, max_tokens=3, ignore_eos=True)["choices"][0]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert chunks[0]["choices"][0]["text"].startswith(TEXT)
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["logprobs"]["tokens"] and len(tokens) == len(ids) + 3
    logprobs = [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert logprobs[0] is None and logprobs[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=TOL)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": TEXT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1 w2"}]})])
def test_continuous_usage_stats_on_every_chunk(server, path, body):
    chunks = sse(server, path, {**body, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 4
    prompt = final["usage"]["prompt_tokens"]
    assert all(set(c["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"} for c in chunks[:-1])
    seen = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert seen == sorted(seen) and seen[-1] == 4
    assert all(c["usage"]["prompt_tokens"] == prompt and c["usage"]["total_tokens"] == prompt + k
               for c, k in zip(chunks[:-1], seen))
    # Without continuous_usage_stats, only the last chunk counts.
    chunks = sse(server, path, {**body, "max_tokens": 2, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] == 2


def test_score_tokens_over_several_slices_of_rows():
    from runtime.model.sampler import SCORE_ROWS, score_tokens

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2 * SCORE_ROWS + 5, 50, generator=generator) * 4
    targets = torch.randint(0, 50, (logits.shape[0],), generator=generator).tolist()
    scored = score_tokens(logits, targets, 3)
    ref = logits.log_softmax(-1)
    assert len(scored) == len(targets)
    for row, (s, t) in enumerate(zip(scored, targets)):
        assert s.logprob == pytest.approx(ref[row, t].item(), abs=1e-6)
        assert s.rank == int((ref[row] > ref[row, t]).sum()) + 1
        assert [i for i, _ in s.top] == torch.topk(ref[row], 3).indices.tolist()
    assert score_tokens(logits[:2], targets[:2], 500)[0].top[-1][0] == int(ref[0].argmin())  # k capped at vocab
