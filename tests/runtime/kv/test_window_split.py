"""Sliding layers' KV kept apart (runtime.kv.window_split): a Gemma 3 replica serves a prompt whose KV over
every layer would not fit the budget, with transformers' tokens, its sliding blocks released as they
leave the window; Mistral's all-sliding layers too; a model without sliding layers keeps one cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from runtime.kv.window_split import pool_sizes
from runtime.wire.params import SamplingParams, SearchParams
from runtime.wire.protocol import Delta, GenerateRequest
from scheduler.sliding_window import SlidingWindow
from tests.conftest import VOCAB, build_tokenizer
from tests.runtime.engine_helpers import engine_for, hf_greedy, request, run
from tests.runtime.model.test_decoder import PROMPTS
from tests.runtime.model.test_decoder_gemma3 import LONG_PROMPT, WINDOW, write_gemma3
from tests.runtime.search.test_search_engine import run_search

# 8 blocks of every layer: the 40 tokens of LONG_PROMPT and 10 new ones need 10 of them
SMALL = dict(num_blocks=8, max_num_seqs=1, max_num_batched_tokens=8)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return write_gemma3(tmp_path_factory.mktemp("window-gemma3"))


@pytest.fixture(scope="module")
def reference(gemma3):
    return AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.float32).eval()


def ceil_div(a, b):
    return -(-a // b)


def test_the_budget_is_split_by_what_each_group_needs():
    # a window of 8 in blocks of 4: 4 blocks a sequence, 2 for a step of 8 tokens; the rest to the full layers
    assert pool_sizes(8, 3, 2, 8, 4, 1, 8, 512) == (12, 6)
    assert pool_sizes(8, 3, 2, 8, 4, 4, 8, 512) == (8, 8)  # the need is over the budget: no fewer than before
    assert pool_sizes(24, 3, 2, 8, 4, 4, 16, 512) == (32, 20)
    assert pool_sizes(8, 2, 2, 8, 4, 1, 8, 512) == (128, 8)  # all sliding: the first pool only names blocks


def test_gemma3_serves_a_prompt_over_the_budget_with_transformers_tokens(gemma3, reference):
    """The budget of 8 blocks of every layer is 12 blocks of the full layer and 6 of the two sliding ones;
    each step's block counts are exact: a sliding block goes when it leaves the next token's window."""
    engine = engine_for(gemma3, **SMALL)
    assert engine.cache.shape.num_layers == 1 and engine.runner.window.cache.shape.num_layers == 2
    assert (engine.pool.num_blocks, engine.kv.window.pool.num_blocks) == (12, 6)
    assert engine.runner.window.places == ((True, 0), (True, 1), (False, 0))
    assert engine.kv.num_blocks_for(len(LONG_PROMPT) + 10) > SMALL["num_blocks"]
    engine.add_request(request("0", LONG_PROMPT, max_tokens=10))
    seen, tokens = [], []
    while engine.has_work:
        tokens += [t for m in engine.step() if isinstance(m, Delta) for t in m.token_ids]
        engine.check_integrity()
        for seq in engine.scheduler.running:
            c = seq.num_computed_tokens
            first = max(0, c - WINDOW + 1) // 4  # the first block the query at c reads
            assert seq.window_table[:first] == [None] * first and None not in seq.window_table[first:]
            seen.append((c, engine.pool.num_used, engine.kv.window.pool.num_used))
    assert [c for c, _, _ in seen] == [8, 16, 24, 30, *range(31, 39)]  # (the last step ends it: freed)
    assert [used for _, used, _ in seen] == [ceil_div(c, 4) for c, _, _ in seen]
    assert [window for _, _, window in seen] == [2, 2, 2, 3, 2, 2, 3, 3, 2, 2, 3, 3]
    assert tokens == hf_greedy(reference, LONG_PROMPT, 10)
    assert (engine.pool.num_used, engine.kv.window.pool.num_used) == (0, 0)
    # 39 tokens' KV written: 9 full blocks named in each pool; the sliding pool of 6 keeps the last 5 of
    # them (it reclaimed the oldest for the blocks after), the partial 10th block is free
    assert engine.runtime_stats().kv_blocks == {"cpu/used": 0, "cpu/cached": 9, "cpu/free": 3, "cpu-window/used": 0,
                                                "cpu-window/cached": 5, "cpu-window/free": 1}


def test_a_prefix_hit_after_the_window_s_blocks_were_released(gemma3, reference):
    """The same prompt again: its 7 full blocks are named in the full layers' pool; the sliding pool still
    holds the window before the hit's end (blocks 5 and 6), so all 28 tokens are served from the cache."""
    engine = engine_for(gemma3, **SMALL)
    first = run(engine, [request("0", LONG_PROMPT, max_tokens=10)])
    hits = engine.kv.prefix_stats.hit_tokens
    again = run(engine, [request("1", LONG_PROMPT, max_tokens=10)])
    assert again["1"]["choices"] == first["0"]["choices"]
    assert engine.kv.prefix_stats.hit_tokens - hits == 28


def test_seeded_sampling_is_the_same_alone_in_a_crowd_and_with_one_cache(gemma3, monkeypatch):
    """n=2 forks the prompt's blocks, the sliding ones too; a crowd shares the pools; one cache for every
    layer (today's layout) gives the same tokens."""
    sampled = dict(max_tokens=9, temperature=0.8, seed=7, n=2)
    alone = run(engine_for(gemma3, **SMALL), [request("0", LONG_PROMPT, **sampled)])["0"]["choices"]
    crowd = run(engine_for(gemma3, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=16),
                [request("0", LONG_PROMPT, **sampled)] +
                [request(str(i + 1), p, max_tokens=9, temperature=0.8, seed=i) for i, p in enumerate(PROMPTS)])
    assert crowd["0"]["choices"] == alone
    monkeypatch.setattr("runtime.kv.window_split.plan_split", lambda *args: None)
    whole = engine_for(gemma3, num_blocks=64)
    assert whole.kv.window is None and whole.runner.window is None
    assert run(whole, [request("0", LONG_PROMPT, **sampled)])["0"]["choices"] == alone


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    directory = tmp_path_factory.mktemp("window-mistral")
    torch.manual_seed(5)
    config = MistralConfig(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
                           max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = MistralForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(directory, safe_serialization=True)
    build_tokenizer(directory)
    return directory


def test_mistral_s_every_layer_slides_and_serves_over_the_budget(mistral):
    """torch's own layers (quantize none: no stack kernel): every layer's KV in the sliding pool, released
    behind the window; the first pool holds no memory and only names the blocks."""
    reference = AutoModelForCausalLM.from_pretrained(mistral, dtype=torch.float32).eval()
    engine = engine_for(mistral, quantize="none", **SMALL)
    assert engine.cache.kv.numel() == 0 and engine.runner.window.cache.shape.num_layers == 2
    assert (engine.pool.num_blocks, engine.kv.window.pool.num_blocks) == (128, 8)
    served = run(engine, [request("0", LONG_PROMPT, max_tokens=10)])
    assert served["0"]["choices"][0] == hf_greedy(reference, LONG_PROMPT, 10)


def test_the_stack_kernel_and_a_model_without_sliding_layers_keep_one_cache(mistral, tiny_llama):
    stacked = engine_for(mistral, num_blocks=16)  # quantize auto: ponder's float kernel, the stack kernel
    assert stacked.runner.decoder.stack is not None and stacked.kv.window is None
    assert stacked.cache.shape.num_layers == 2 and stacked.pool.num_blocks == 16
    plain = engine_for(tiny_llama, num_blocks=16)
    assert plain.kv.window is None and plain.runner.window is None and plain.pool.num_blocks == 16


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_decode_attention_in_torch_and_triton_reads_the_window_s_cache(gemma3, reference, path):
    """Generated tokens attended by torch's batched matmuls (no CPU kernel), or by the Triton kernel (in
    Triton's interpreter here), through the sliding layers' tables: transformers' greedy tokens."""
    engine = engine_for(gemma3, **SMALL)
    if path == "torch":
        engine.runner.attention_kernel = None
    else:
        engine.runner.use_gpu_kernels()
    served = run(engine, [request("0", LONG_PROMPT, max_tokens=6)])
    assert served["0"]["choices"][0] == hf_greedy(reference, LONG_PROMPT, 6)


def test_a_beam_search_s_forks_share_the_window_s_blocks(gemma3, monkeypatch):
    """Beam paths fork at each step's end, sharing the sliding blocks of the window before it; the answer
    and its scores are one cache's."""
    shared = []
    fork = SlidingWindow.fork

    def spy(self, parent, child, num_blocks):
        taken = fork(self, parent, child, num_blocks)
        shared.append(sum(b is not None for b in child.window_table) if taken else None)
        return taken

    monkeypatch.setattr(SlidingWindow, "fork", spy)
    params = SearchParams(strategy="beam", n=4, beam_width=2, max_steps=3, max_step_tokens=4, verifier="confidence")
    search = GenerateRequest(request_id="s", endpoint="completion", prompt_token_ids=tuple(LONG_PROMPT),
                             sampling=SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True),
                             search=params)
    split = run_search(engine_for(gemma3, num_blocks=24, max_num_seqs=8, max_num_batched_tokens=16), search)
    assert shared and all(count is not None and 0 < count <= 3 for count in shared)
    monkeypatch.setattr("runtime.kv.window_split.plan_split", lambda *args: None)
    whole = run_search(engine_for(gemma3, num_blocks=64), search)

    def outcome(messages):  # (every delta, and what the search explored; not its seconds)
        summary = messages[-1].search
        return [m for m in messages if isinstance(m, Delta)], (summary.paths_explored, summary.tokens_generated)

    assert outcome(whole) == outcome(split) and outcome(split)[1] == (9, 62)


def test_the_judge_s_questions_forked_behind_the_window_get_one_cache_s_scores(gemma3, monkeypatch):
    """The judge asks the generator about each path: its questions fork earlier questions far behind their
    ends (past the window), taking released blocks by name or computing again; the same answer and scores."""
    params = SearchParams(strategy="beam", n=4, beam_width=2, max_steps=2, max_step_tokens=4, verifier="judge")
    search = GenerateRequest(request_id="j", endpoint="chat", messages=({"role": "user", "content": "w1 w2 w3"},),
                             sampling=SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True),
                             search=params)
    split = run_search(engine_for(gemma3, num_blocks=32, max_num_seqs=8, max_num_batched_tokens=16), search)
    monkeypatch.setattr("runtime.kv.window_split.plan_split", lambda *args: None)
    whole = run_search(engine_for(gemma3, num_blocks=128), search)
    assert [m for m in split if isinstance(m, Delta)] == [m for m in whole if isinstance(m, Delta)]
    assert split[-1].search.verifier_calls == whole[-1].search.verifier_calls > 0
