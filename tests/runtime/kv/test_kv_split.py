"""The roofline KV split wired through build_engine: pool sizes from the model, caps on load changes.

Generator: tests/conftest's tiny llama (2 layers, hidden 64, MLP 128, 4 query and 2 KV heads of 16,
78-token vocabulary, untied head). Verifier: a tiny qwen2 (3 layers, same widths, q/k/v biases) used
as a Math-Shepherd PRM. float32 on the CPU, blocks of 4 tokens, max_model_len 512.
"""

import dataclasses

import pytest

from runtime.bootstrap import build_engine
from runtime.kv.kv_split import default_workload, model_cost
from runtime.wire.options import RuntimeOptions
from scheduler.roofline import ModelCost, Workload
from tests.conftest import build_model

# Per layer: q, o 64 x 64, k, v 64 x 32 (4096 + 2048 + 2048 + 4096), MLP 3 x 64 x 128, 2 norms of 64.
GENERATOR = ModelCost(weight_bytes=4 * 79_040,  # 2 x 36_992 per layer + final norm 64 + head 78 x 64
                      flops_per_token=2 * 79_040, attention_flops_per_context_token=4 * 2 * 4 * 16,
                      block_bytes=2 * 2 * 2 * 4 * 16 * 4, block_size=4)  # 2048 B: 512 B a token
VERIFIER = ModelCost(weight_bytes=4 * 111_424,  # 3 x (36_992 + 128 of biases) + final norm; no head
                     flops_per_token=2 * 111_424, attention_flops_per_context_token=4 * 3 * 4 * 16,
                     block_bytes=2 * 3 * 2 * 4 * 16 * 4, block_size=4)  # 3072 B: 768 B a token
BUDGET = (4 << 20) + (2 << 20)  # kv_memory_bytes + one verifier's verifier_kv_memory_bytes


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("tiny-prm"), "qwen2", seed=2, layers=3)


def roofline_engine(tiny_llama, prm_dir, kv_split="roofline", **options):
    settings = dict(model=str(tiny_llama), device="cpu", block_size=4, kv_memory_bytes=4 << 20,
                    verifier_kv_memory_bytes=2 << 20, kv_split=kv_split,
                    verifiers={"prm": {"kind": "math-shepherd", "path": str(prm_dir)}})
    settings.update(options)
    engine, _ = build_engine(RuntimeOptions(**settings))
    return engine


def test_model_costs_count_the_matmul_weights_by_hand(tiny_llama, prm_dir):
    engine = roofline_engine(tiny_llama, prm_dir, kv_split="static")
    assert model_cost(engine.model, 4, with_head=True) == GENERATOR
    assert model_cost(engine.scorers["prm"].verifier.model, 4, with_head=False) == VERIFIER
    # 16 paths; 512 of context and verifier input (cut to max_model_len), 128 tokens decoded.
    assert default_workload(512) == Workload(num_sequences=16, verifier_input_tokens=512, generation_tokens=128,
                                             avg_context_tokens=512)
    assert default_workload(4096) == Workload(num_sequences=16, verifier_input_tokens=896, generation_tokens=128,
                                              avg_context_tokens=832)


def test_static_split_keeps_the_configured_pools(tiny_llama, prm_dir):
    engine = roofline_engine(tiny_llama, prm_dir, kv_split="static")
    assert engine.kv_split is None
    assert engine.pool.num_blocks == (4 << 20) // 2048
    assert engine.scorers["prm"].pool.num_blocks == (2 << 20) // 3072


def test_bandwidth_bound_peaks_batch_the_verifier(tiny_llama, prm_dir):
    # 1 TFLOP/s, 1 GB/s: every stage is bound by bytes. A verifier sequence is 128 blocks (393_216 B),
    # a generator one 128 blocks (262_144 B). B_p=4 leaves 4_718_592 B: B_d = 16 (= R).
    #   verify: 4 batches x (445_696 B of weights + 4 x 512 x 768 B of KV) / 1e9 = 4 x 2.01856 ms
    #   decode: 1 batch x 128 tokens x (316_160 + 16 x 512 x 512 B) / 1e9 = 128 x 4.510464 ms
    # B_p=3 and 5 keep B_d = 16 but take 6 x 1.625 ms and 4 x 2.412 ms to verify; B_p=6 leaves room
    # for only 15 decoding paths: two decode batches.
    engine = roofline_engine(tiny_llama, prm_dir, peak_flops=1e12, memory_bandwidth=1e9)
    split = engine.kv_split.split
    assert (split.prefill_batch, split.decode_batch) == (4, 16)
    assert split.prefill_seconds == pytest.approx(4 * 2.01856e-3)
    assert split.decode_seconds == pytest.approx(128 * 4.510464e-3)
    assert engine.scorers["prm"].pool.num_blocks == 4 * 128 == engine.kv_split.verifier_blocks["prm"]
    assert engine.pool.num_blocks == (BUDGET - 4 * 128 * 3072) // 2048 == 2304
    assert engine.cache.num_blocks == 2304 and engine.scorers["prm"].cache.num_blocks == 512
    assert engine.kv_split.peak_source.describe() == "1 TFLOP/s (configured), 1 GB/s (configured)"


def test_compute_bound_peaks_batch_the_verifier_only_while_all_paths_decode_together(tiny_llama, prm_dir):
    # 1 GFLOP/s: batching buys nothing; B_p = 1, 2 and 4 tie (ceil(16 / B) x B = 16 sequences' FLOPs)
    # with B_d = 16 for all three, and the tie goes to the larger B_p; B_p = 8 leaves 12 decoding.
    engine = roofline_engine(tiny_llama, prm_dir, peak_flops=1e9, memory_bandwidth=1e15)
    split = engine.kv_split.split
    assert (split.prefill_batch, split.decode_batch) == (4, 16)
    # 16 x (512 x 222_848 + 768 x 512 x 513 / 2) FLOPs to verify, 16 x 128 x (158_080 + 512 x 512) to decode.
    assert split.prefill_seconds == pytest.approx(16 * (512 * 222_848 + 768 * 131_328) / 1e9)
    assert split.decode_seconds == pytest.approx(16 * 128 * (158_080 + 512 * 512) / 1e9)
    assert engine.scorers["prm"].pool.num_blocks == 512 and engine.pool.num_blocks == 2304
    # A smaller budget: B_d = 16 leaves room for two verifier sequences only (1 MiB / 384 KiB).
    engine = roofline_engine(tiny_llama, prm_dir, peak_flops=1e9, memory_bandwidth=1e15, kv_memory_bytes=3 << 20)
    assert (engine.kv_split.split.prefill_batch, engine.kv_split.split.decode_batch) == (2, 16)
    assert engine.scorers["prm"].pool.num_blocks == 256
    assert engine.pool.num_blocks == ((5 << 20) - 256 * 3072) // 2048 == 2176


def test_roofline_without_a_reward_model_changes_nothing(tiny_llama):
    engine, _ = build_engine(RuntimeOptions(model=str(tiny_llama), device="cpu", block_size=4,
                                            kv_memory_bytes=1 << 20, kv_split="roofline"))
    assert engine.kv_split is None and engine.pool.num_blocks == 512


def test_an_unset_peak_is_measured(tiny_llama, prm_dir):
    engine = roofline_engine(tiny_llama, prm_dir, peak_flops=2e12)
    source = engine.kv_split.peak_source
    assert (source.flops_measured, source.bandwidth_measured) == (False, True)
    assert source.peaks.flops == 2e12 and 1e8 < source.peaks.bandwidth < 1e13
    assert engine.pool.num_blocks * 2048 + engine.scorers["prm"].pool.num_blocks * 3072 <= BUDGET


def test_a_budget_too_small_for_one_sequence_of_each_fails_clearly(tiny_llama, prm_dir):
    with pytest.raises(ValueError, match="cannot hold one verifier input"):
        build_engine(RuntimeOptions(
            model=str(tiny_llama), device="cpu", block_size=4, kv_memory_bytes=256 << 10,
            verifier_kv_memory_bytes=256 << 10, kv_split="roofline", peak_flops=1e12, memory_bandwidth=1e9,
            verifiers={"prm": {"kind": "math-shepherd", "path": str(prm_dir)}}))


def test_rechoose_caps_the_generator_blocks_and_the_verifier_step(tiny_llama, prm_dir):
    engine = roofline_engine(tiny_llama, prm_dir, peak_flops=1e12, memory_bandwidth=1e9)
    store = engine.scorers["prm"]
    assert store.step_token_budget == store.max_batched_tokens  # no cap until the engine asks
    # The start-up load inside the start-up pools: the same batches.
    caps = engine.kv_split.rechoose(16, 512, 512)
    assert (caps.prefill_batch, caps.decode_batch) == (4, 16)
    assert (caps.generator_blocks, caps.verifier_tokens_per_step) == (16 * 128, 4 * 512)
    # 8 paths over 100 tokens, verifier inputs of 64 (16 blocks, 32 fit the store): one batch of each.
    caps = engine.kv_split.rechoose(8, 100, 64)
    assert (caps.prefill_batch, caps.decode_batch) == (8, 8)
    assert (caps.generator_blocks, caps.verifier_tokens_per_step) == (8 * 25, 8 * 64)
    assert engine.kv_split.rechoose(8, 97, 61) is caps  # the same load in whole blocks: memoized
    engine.kv_split.apply(caps, engine.verifier_stores)
    assert store.step_token_budget == 512
    # A sequence longer than a pool: no smaller caps than the pools themselves.
    caps = engine.kv_split.rechoose(4, 100_000, 100_000)
    assert (caps.generator_blocks, caps.verifier_tokens_per_step) == (2304, 512 * 4)
    store.cap_prefill_tokens(None)
    assert store.step_token_budget == store.max_batched_tokens
    with pytest.raises(ValueError):
        store.cap_prefill_tokens(0)


def test_a_capped_verifier_scores_a_search_exactly_as_an_uncapped_one(tiny_llama, tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    from tests.runtime.conftest import build_tokenizer, model_config, save
    from tests.runtime.search.test_search_engine import engine_choices, run_search, search_request

    tokenizer = build_tokenizer()  # byte-level BPE with the offsets Math-Shepherd's step tags need
    torch.manual_seed(0)
    shepherd = save(tmp_path, LlamaForCausalLM(model_config("llama", len(tokenizer))), tokenizer)
    results, batch_sizes, chosen = [], [], []
    for cap in (None, 1):  # 1 token: one scoring job a step
        engine = roofline_engine(tiny_llama, shepherd, peak_flops=1e12, memory_bandwidth=1e9)
        store = engine.scorers["prm"]
        if cap is not None:  # the engine re-chooses the caps each step: make its choice a 1-token cap
            rechoose = engine.kv_split.rechoose
            engine.kv_split.rechoose = lambda *load: dataclasses.replace(rechoose(*load), verifier_tokens_per_step=1)
        else:
            engine.kv_split.apply = lambda caps, stores, apply=engine.kv_split.apply: (
                chosen.append(caps), apply(dataclasses.replace(caps, verifier_tokens_per_step=10**6), stores))
        forward, sizes = store.runner.hidden_states, []
        store.runner.hidden_states = lambda scheduled, *rest: sizes.append(len(scheduled)) or forward(scheduled, *rest)
        messages = run_search(engine, search_request("capped", verifier="prm", n=4, beam_width=2, max_steps=3,
                                                          greedy_anchor=False))  # its four paths alone
        results.append(engine_choices(messages))
        batch_sizes.append(sizes)
        assert store.last_input_tokens > 0  # the verifier load, for KVSplitter.rechoose
        store.pool.check_integrity([])
    assert chosen and all(caps.decode_batch >= 1 for caps in chosen)  # asked at every step's start
    assert max(batch_sizes[0]) == 4 and set(batch_sizes[1]) == {1}
    assert sum(batch_sizes[0]) == sum(batch_sizes[1])
    (uncapped, capped) = results
    assert [text for text, _, _ in capped] == [text for text, _, _ in uncapped] and uncapped
    for (_, score, steps), (_, ref_score, ref_steps) in zip(capped, uncapped):  # batch shape: float noise only
        assert score == pytest.approx(ref_score, rel=1e-5) and steps == pytest.approx(ref_steps, rel=1e-5)
