import pytest

from transformers import AutoModelForCausalLM

from runtime.wire.protocol import RequestError
from tests.runtime.engine_helpers import engine_for, hf_greedy, request, run

PROMPTS = [
    [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
    [1, 20, 21],
    [1, 30, 31, 32, 33, 34, 35],
    [1, 40],
]


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen2"])
def model_dir(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_greedy_batch_matches_transformers_generate(model_dir, reference, batch_invariant):
    engine = engine_for(model_dir, batch_invariant=batch_invariant)
    results = run(engine, [request(str(i), p, max_tokens=10) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        assert results[str(i)]["choices"][0] == hf_greedy(reference, prompt, 10)
        assert results[str(i)]["finish_reasons"][0] == "length"
    assert engine.pool.num_used == 0
    engine.pool.check_integrity([])


def test_shared_prefix_hits_the_cache_and_gives_the_same_tokens(model_dir, reference):
    engine = engine_for(model_dir)
    prefix = [1] + list(range(5, 17))  # 13 tokens: three full blocks of 4
    first = run(engine, [request("a", prefix + [40, 41], max_tokens=6)])
    second = run(engine, [request("b", prefix + [50], max_tokens=6)])
    assert first["a"]["finished"].cached_tokens == 0
    assert second["b"]["finished"].cached_tokens == 12
    assert second["b"]["choices"][0] == hf_greedy(reference, prefix + [50], 6)
    assert engine.kv.prefix_stats.hit_tokens == 12


def test_concurrent_requests_with_a_shared_prefix(model_dir, reference):
    engine = engine_for(model_dir, max_num_batched_tokens=16)  # chunked prefill as well
    prefix = [1] + list(range(5, 25))
    prompts = [prefix + [30 + i] for i in range(3)]
    results = run(engine, [request(str(i), p, max_tokens=7) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert results[str(i)]["choices"][0] == hf_greedy(reference, p, 7)


def test_n_greedy_forks_share_the_prompt_blocks(model_dir, reference):
    engine = engine_for(model_dir)
    prompt = PROMPTS[0]  # 11 tokens: blocks of 4 -> 2 full + 1 partial
    engine.add_request(request("r", prompt, max_tokens=6, n=3))
    engine.step()  # prefill + fork + first token of every choice
    seqs = [c.seq for c in engine.requests["r"].choices]
    assert all(s.block_table == seqs[0].block_table for s in seqs)
    assert [engine.pool.ref_counts[b] for b in seqs[0].block_table] == [3, 3, 3]
    engine.check_integrity()
    engine.step()  # each choice writes into the shared partial block: copy-on-write for two of them
    tables = [s.block_table for s in seqs]
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert len({t[2] for t in tables}) == 3
    engine.check_integrity()
    while engine.has_work:
        messages = engine.step()
        engine.check_integrity()
    expected = hf_greedy(reference, prompt, 6)
    assert all(s.output_token_ids == expected for s in seqs)
    assert messages[-1].completion_tokens == 18
    assert engine.pool.num_used == 0


def test_sampling_with_a_seed_is_reproducible_and_batch_independent(model_dir):
    engine = engine_for(model_dir)
    sampled = dict(max_tokens=8, temperature=1.0, seed=1234, n=3)
    alone = run(engine, [request("a", PROMPTS[0], **sampled)])["a"]["choices"]
    mixed = run(engine, [request("x", PROMPTS[1], max_tokens=5, temperature=0.7, seed=9),
                         request("b", PROMPTS[0], **sampled),
                         request("y", PROMPTS[2], max_tokens=9)])["b"]["choices"]
    assert alone == mixed
    assert len({tuple(v) for v in alone.values()}) > 1  # the choices differ from one another


def test_preemption_under_memory_pressure_keeps_results(model_dir, reference):
    # 12 blocks of 4 tokens cannot hold four 20-token sequences at once: some are preempted.
    engine = engine_for(model_dir, num_blocks=12)
    prompts = [[1] + list(range(5 + 3 * i, 12 + 3 * i)) for i in range(4)]
    results = run(engine, [request(str(i), p, max_tokens=12) for i, p in enumerate(prompts)])
    assert sum(len(v["choices"][0]) for v in results.values()) == 48
    for i, p in enumerate(prompts):
        assert results[str(i)]["choices"][0] == hf_greedy(reference, p, 12)


def test_stop_token_ids_and_eos(model_dir, reference):
    engine = engine_for(model_dir)
    expected = hf_greedy(reference, PROMPTS[0], 10)
    stop_at = expected[3]
    out = run(engine, [request("s", PROMPTS[0], max_tokens=10, stop_token_ids=[stop_at])])["s"]
    first = expected.index(stop_at)
    assert out["choices"][0] == expected[:first + 1]
    assert out["finish_reasons"][0] == "stop"


def test_stop_strings_cut_the_text(tiny_llama):
    engine = engine_for(tiny_llama)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    expected_ids = hf_greedy(reference, PROMPTS[0], 10)
    words = [engine.tokenizer.decode([t]) for t in expected_ids]
    full = engine.tokenizer.decode(expected_ids)
    stop = words[4]
    out = run(engine, [request("s", PROMPTS[0], max_tokens=10, stop=(stop,))])["s"]
    assert out["text"][0] == full[:full.index(stop)]
    assert out["finish_reasons"][0] == "stop"
    kept = run(engine, [request("k", PROMPTS[0], max_tokens=10, stop=(stop,), include_stop_str_in_output=True)])["k"]
    assert kept["text"][0] == full[:full.index(stop) + len(stop)]


def test_abort_frees_every_block(tiny_llama):
    engine = engine_for(tiny_llama)
    engine.add_request(request("r", PROMPTS[0], max_tokens=50, n=4))
    engine.step()
    engine.step()
    assert engine.pool.num_used > 0
    engine.abort("r")
    assert engine.pool.num_used == 0 and not engine.has_work
    engine.check_integrity()


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(max_tokens=600), "maximum context length"),
    (dict(stop_token_ids=(10_000,)), "stop_token_ids"),
])
def test_invalid_requests_are_refused_without_side_effects(tiny_llama, kwargs, fragment):
    engine = engine_for(tiny_llama)
    out = engine.add_request(request("bad", PROMPTS[0], **kwargs))
    assert isinstance(out[0], RequestError) and out[0].status == 400 and fragment in out[0].message
    assert not engine.has_work and engine.pool.num_used == 0


def test_kv_tensor_layout_makes_a_block_one_unit(tiny_llama):
    engine = engine_for(tiny_llama)
    kv = engine.cache.kv
    # blocks (and the scratch block padding tokens write to), layers, k/v, kv heads, block size, head dim
    assert kv.shape == (128 + 1, 2, 2, 2, 4, 16) and engine.cache.scratch_block == 128
    assert engine.cache.read_block(3).is_contiguous()
    assert engine.cache.bytes_per_block == 2 * 2 * 2 * 4 * 16 * 4
    assert kv[3].data_ptr() - kv[2].data_ptr() == engine.cache.bytes_per_block
