"""The roofline KV split on small hand-built cases whose every figure is worked out by hand below."""

import pytest

from scheduler import roofline
from scheduler.roofline import DevicePeaks, ModelCost, Workload, choose_batches, choose_split

# Bandwidth-bound: FLOPs are free, every byte costs 1 ms.
MEMORY_BOUND = DevicePeaks(flops=1e15, bandwidth=1000.0)
GEN_A = ModelCost(weight_bytes=10_000, flops_per_token=0, attention_flops_per_context_token=0,
                  block_bytes=100, block_size=4)  # 25 KV bytes per token
VER_A = ModelCost(weight_bytes=20_000, flops_per_token=0, attention_flops_per_context_token=0,
                  block_bytes=200, block_size=4)  # 50 KV bytes per token
# R=4; verifier inputs of 8 tokens (2 blocks, 400 B); 10 tokens decoded over 8 of context (2 blocks, 200 B).
LOAD_A = Workload(num_sequences=4, verifier_input_tokens=8, generation_tokens=10, avg_context_tokens=8)

# Compute-bound: bytes are free, 1000 FLOP/s.
COMPUTE_BOUND = DevicePeaks(flops=1000.0, bandwidth=1e15)
GEN_B = ModelCost(weight_bytes=0, flops_per_token=100, attention_flops_per_context_token=1,
                  block_bytes=100, block_size=4)
VER_B = ModelCost(weight_bytes=0, flops_per_token=50, attention_flops_per_context_token=2,
                  block_bytes=200, block_size=4)
LOAD_B = Workload(num_sequences=4, verifier_input_tokens=4, generation_tokens=2, avg_context_tokens=4)


def test_stage_latencies_take_the_slower_roof():
    # Prefill of 2 x 8 tokens: weights 20000 B + 2*8*50 B of KV written = 20800 B -> 20.8 s.
    assert VER_A.prefill_latency(MEMORY_BOUND, 2, 8) == pytest.approx(20.8)
    # Decode of 4 over 8 tokens: 10000 B + 4*8*25 B of KV read = 10800 B -> 10.8 s.
    assert GEN_A.decode_latency(MEMORY_BOUND, 4, 8) == pytest.approx(10.8)
    # Prefill of 1 x 4 tokens: 4*50 + 2 * (1+2+3+4) = 220 FLOPs -> 0.22 s.
    assert VER_B.prefill_latency(COMPUTE_BOUND, 1, 4) == pytest.approx(0.22)
    # Decode of 3 over 4 tokens: 3 * (100 + 1*4) = 312 FLOPs -> 0.312 s.
    assert GEN_B.decode_latency(COMPUTE_BOUND, 3, 4) == pytest.approx(0.312)


def test_bandwidth_bound_split_batches_the_verifier_until_decoding_would_shrink():
    # B_p=1: B_d=min(4, 1600//200)=4: 4*20.4 + 1*10*10.8 = 189.6 s
    # B_p=2: B_d=min(4, 1200//200)=4: 2*20.8 + 108      = 149.6 s   <- best
    # B_p=3: B_d=min(4,  800//200)=4: 2*21.2 + 108      = 150.4 s
    # B_p=4: B_d=400//200=2:          1*21.6 + 2*10*10.4 = 229.6 s
    split = choose_split(2000, GEN_A, [VER_A], LOAD_A, MEMORY_BOUND)
    assert (split.prefill_batch, split.decode_batch) == (2, 4)
    assert split.verifier_blocks == (4,) and split.verifier_bytes == (800,)
    assert (split.generator_blocks, split.generator_bytes) == (12, 1200)  # all the rest, whole blocks
    assert split.prefill_seconds == pytest.approx(41.6)
    assert split.decode_seconds == pytest.approx(108.0)
    assert split.predicted_seconds == pytest.approx(149.6)


def test_the_generator_share_is_whole_blocks_and_the_budget_is_never_exceeded():
    split = choose_split(2050, GEN_A, [VER_A], LOAD_A, MEMORY_BOUND)
    assert (split.generator_blocks, split.generator_bytes, split.verifier_bytes) == (12, 1200, (800,))


def test_compute_bound_split_batches_the_verifier_only_while_decoding_keeps_its_batch():
    # Batching buys nothing when compute-bound: ceil(4/B) * B is 4 for B in 1, 2, 4 and 6 for B=3.
    # B_p=1: B_d=4: 4*0.22 + 1*2*0.416 = 1.712 s; B_p=2: B_d=4: 1.712 s (tie, same B_d: the larger B_p)
    # B_p=3: B_d=4: 2*0.66 + 0.832 = 2.152 s;     B_p=4: B_d=2: 0.88 + 2*2*0.208 = 1.712 s (tie, smaller B_d)
    split = choose_split(1000, GEN_B, [VER_B], LOAD_B, COMPUTE_BOUND)
    assert (split.prefill_batch, split.decode_batch) == (2, 4)
    assert split.verifier_blocks == (2,) and split.generator_blocks == 6
    assert split.predicted_seconds == pytest.approx(1.712)


def test_a_tie_goes_to_the_larger_decode_batch():
    # Decoding free: only the prefill counts, and B_p = 1, 2 and 4 all take 0.88 s. The budget leaves
    # B_d = 4, 3, 2, 1 for B_p = 1..4 (700 - 200 B_p over 100 B a sequence, at most R=4).
    free_decode = ModelCost(weight_bytes=0, flops_per_token=0, attention_flops_per_context_token=0,
                            block_bytes=100, block_size=4)
    split = choose_split(1000 - 300, free_decode, [VER_B], LOAD_B, COMPUTE_BOUND)
    assert (split.prefill_batch, split.decode_batch) == (1, 4)
    # Weights of 100 B read per prefill batch at 1000 B/s: bigger batches are now faster
    # (B_p=1: 4 * 0.3 s, 2: 2 * 0.5 s, 3: 2 * 0.7 s, 4: 1 * 0.9 s); decoding reads 25 B of KV a token
    # of context: 0.8 s for B_d = 4 (1 * 2 * 0.4 s), 2 and 1 alike, 1.2 s for B_d = 3. With 900 B,
    # B_p = 1..4 leave B_d = 4, 4, 3, 1: 2.0, 1.8, 2.6 and 1.7 s, so speed beats the larger B_d.
    weighted = ModelCost(weight_bytes=100, flops_per_token=50, attention_flops_per_context_token=2,
                         block_bytes=200, block_size=4)
    split = choose_split(900, free_decode, [weighted], LOAD_B, DevicePeaks(flops=1000.0, bandwidth=1000.0))
    assert (split.prefill_batch, split.decode_batch) == (4, 1)
    assert split.predicted_seconds == pytest.approx(1.7)


def test_two_verifiers_each_hold_the_prefill_batch():
    # Each store needs 400 B per verifier sequence: B_p=1 leaves 1200 B (B_d=4): 81.6 + 108 = 189.6 s;
    # B_p=2 leaves 400 B (B_d=2): 41.6 + 208 = 249.6 s.
    split = choose_split(2000, GEN_A, [VER_A, VER_A], LOAD_A, MEMORY_BOUND)
    assert (split.prefill_batch, split.decode_batch) == (1, 4)
    assert split.verifier_blocks == (2, 2) and split.verifier_bytes == (400, 400)
    assert split.generator_blocks == 12


def test_the_smallest_feasible_budget_and_one_byte_less():
    split = choose_split(600, GEN_A, [VER_A], LOAD_A, MEMORY_BOUND)
    assert (split.prefill_batch, split.decode_batch, split.generator_blocks, split.verifier_blocks) == (1, 1, 2, (2,))
    with pytest.raises(ValueError, match="KV budget of 599 bytes cannot hold one verifier input"):
        choose_split(599, GEN_A, [VER_A], LOAD_A, MEMORY_BOUND)
    with pytest.raises(ValueError, match="at least one verifier"):
        choose_split(2000, GEN_A, [], LOAD_A, MEMORY_BOUND)


def test_invalid_inputs_are_refused():
    with pytest.raises(ValueError):
        DevicePeaks(flops=0.0, bandwidth=1.0)
    with pytest.raises(ValueError):
        DevicePeaks(flops=1.0, bandwidth=float("inf"))
    with pytest.raises(ValueError):
        Workload(num_sequences=0, verifier_input_tokens=8, generation_tokens=1, avg_context_tokens=1)
    with pytest.raises(ValueError):
        ModelCost(weight_bytes=1, flops_per_token=1, attention_flops_per_context_token=1, block_bytes=0, block_size=4)


def test_batches_inside_fixed_pools_follow_the_load():
    # Pools of the bandwidth-bound split: 12 generator blocks, 4 verifier blocks.
    caps = choose_batches(12, [4], GEN_A, [VER_A], LOAD_A, MEMORY_BOUND)
    # B_p <= 4 // 2 = 2: 2*20.8 = 41.6 s beats 4*20.4; B_d <= min(R=4, 12 // 2): 1 * 10 * 10.8 = 108 s.
    assert (caps.prefill_batch, caps.decode_batch) == (2, 4)
    assert (caps.generator_blocks, caps.verifier_tokens_per_step) == (8, 16)
    assert caps.predicted_seconds == pytest.approx(149.6)
    # Twice the paths over twice the context (4 blocks each): B_d <= 12 // 4 = 3, and
    # B_d=3: 3 * 10 * (10000 + 3*16*25) / 1000 = 336 s beats B_d=2 (432 s) and B_d=1 (832 s).
    longer = Workload(num_sequences=8, verifier_input_tokens=8, generation_tokens=10, avg_context_tokens=16)
    caps = choose_batches(12, [4], GEN_A, [VER_A], longer, MEMORY_BOUND)
    assert (caps.prefill_batch, caps.decode_batch) == (2, 3)
    assert (caps.generator_blocks, caps.verifier_tokens_per_step) == (12, 16)
    assert caps.decode_seconds == pytest.approx(336.0)


def test_batches_inside_fixed_pools_break_ties_toward_the_larger_batches():
    # Compute-bound: B = 1, 2 and 4 tie in both stages (ceil(4/B) * B = 4); B_p <= 4 blocks / 1, B_d <= 4.
    caps = choose_batches(8, [4], GEN_B, [VER_B], LOAD_B, COMPUTE_BOUND)
    assert (caps.prefill_batch, caps.decode_batch) == (4, 4)
    assert (caps.generator_blocks, caps.verifier_tokens_per_step) == (4, 16)
    caps = choose_batches(8, [3], GEN_B, [VER_B], LOAD_B, COMPUTE_BOUND)  # B_p = 3 is slower: 2 x 3 sequences
    assert (caps.prefill_batch, caps.verifier_tokens_per_step) == (2, 8)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        choose_batches(8, [1], GEN_A, [VER_A], LOAD_A, MEMORY_BOUND)


def test_a_large_budget_is_searched_in_one_pass_over_the_sequences(monkeypatch):
    """Counted in evaluations, not seconds: the search over B_p tries each batch once, up to what the
    budget holds beside one generator sequence (80 GiB less 19,169,280 bytes, over 22,020,096 bytes a
    verifier input: 3900) and never past the workload's 4096 sequences."""
    gen = ModelCost(weight_bytes=270_000_000, flops_per_token=270_000_000, attention_flops_per_context_token=276_480,
                    block_bytes=368_640, block_size=16)
    ver = ModelCost(weight_bytes=3_000_000_000, flops_per_token=3_000_000_000,
                    attention_flops_per_context_token=688_128, block_bytes=458_752, block_size=16)
    load = Workload(num_sequences=4096, verifier_input_tokens=768, generation_tokens=128, avg_context_tokens=832)
    tried: list[int] = []
    prefill_seconds = roofline.prefill_seconds
    monkeypatch.setattr(roofline, "prefill_seconds",
                        lambda verifiers, workload, peaks, batch: tried.append(batch) or prefill_seconds(
                            verifiers, workload, peaks, batch))
    split = choose_split(80 << 30, gen, [ver], load, DevicePeaks(989e12, 3.35e12))
    assert tried == list(range(1, 3901))
    assert split.generator_bytes + sum(split.verifier_bytes) <= 80 << 30
