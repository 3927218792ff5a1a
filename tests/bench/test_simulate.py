"""The 7B simulation's arithmetic on a hand-made trace (exact bytes and seconds), and the trace the
served engine gives it."""

from __future__ import annotations

import pytest

from bench import served
from bench.sim_replay import Device, TracePath, TraceStep, replay_lbs, replay_token
from bench.simulate import record_trace
from bench.transfer_model import KVLayout, beam_request_bytes, layerwise_request_bytes
from scheduler.roofline import DevicePeaks, ModelCost

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype_bytes=2)  # 16 bytes a token a layer
BLOCK = 2  # tokens: a block is 64 bytes
FREE_COMPUTE = ModelCost(weight_bytes=0, flops_per_token=0, attention_flops_per_context_token=0,
                         block_bytes=BLOCK * LAYOUT.bytes_per_token, block_size=BLOCK)
LINK_64 = Device(DevicePeaks(flops=1e30, bandwidth=1e30), link_bandwidth=64.0)  # one block a second

# Two paths fork off the prompt's block p0 and write a1 and b1; then X and Y continue them, and with
# room for 3 blocks, X's new block c2 pushes b1 out, which Y must load again: one block in all.
TRACE = [
    TraceStep((TracePath(("p0",), 3, 2, ("p0", "a1")), TracePath(("p0",), 3, 2, ("p0", "b1")))),
    TraceStep((TracePath(("p0", "a1"), 5, 1, ("p0", "a1", "c2")), TracePath(("p0", "b1"), 5, 1, ("p0", "b1", "d2")))),
]


def test_lbs_replay_loads_exactly_the_blocks_the_lru_compute_tier_lost():
    out = replay_lbs(TRACE, LAYOUT, FREE_COMPUTE, LINK_64, budget_blocks=3, block_size=BLOCK)
    assert out.num_groups == 4  # every step needs two groups of one path
    assert out.bytes_in == 64  # b1, evicted by c2
    assert out.bytes_out == 4 * 64  # a1, b1, c2, d2 written back
    assert out.seconds == pytest.approx(1.0) and out.stall_seconds == pytest.approx(1.0)


def test_without_sharing_every_path_loads_its_own_copy_each_step():
    out = replay_lbs(TRACE, LAYOUT, FREE_COMPUTE, LINK_64, budget_blocks=3, block_size=BLOCK, share_prefix=False)
    # step 0: p0 for each path (nothing resident as its own copy); step 1: two blocks for each path
    assert out.bytes_in == (1 + 1 + 2 + 2) * 64
    assert out.stall_seconds == pytest.approx(6.0)


def test_with_headroom_the_next_group_is_prefetched_behind_compute():
    slow = ModelCost(weight_bytes=10**30, flops_per_token=0, attention_flops_per_context_token=0,
                     block_bytes=64, block_size=BLOCK)  # each token's forward takes 1 s: loads hide behind it
    step = TraceStep((TracePath(("p0",), 3, 1, ("p0",)), TracePath(("q0",), 3, 1, ("q0",))))
    out = replay_lbs([step], LAYOUT, slow, LINK_64, budget_blocks=3, block_size=BLOCK, max_beams=1)
    # groups [p-path], [q-path]; p0 is resident (the prompt), q0 is prefetched in the first group's headroom
    assert out.bytes_in == 64 and out.num_groups == 2
    assert out.stall_seconds == 0.0 and out.seconds == pytest.approx(2.0)


def test_token_replay_is_eq_2_per_token_and_matches_eq_3():
    step = TraceStep((TracePath(("p0", "p1"), 5, 2, ()), TracePath(("p0", "p1"), 5, 2, ())))
    # token 0: 10 tokens in all, 160 bytes a layer, one layer fits 200 bytes: 160 reloaded; token 1: 192
    out = replay_token([step], LAYOUT, FREE_COMPUTE, LINK_64, budget_bytes=200)
    assert out.bytes_in == 160 + 192 == layerwise_request_bytes(LAYOUT, 2, 5, 2, 200)
    assert out.seconds == pytest.approx(352 / 64) and out.stall_share == pytest.approx(1.0)
    assert replay_token([step], LAYOUT, FREE_COMPUTE, LINK_64, budget_bytes=100).bytes_in == 2 * (160 + 192)
    assert beam_request_bytes(LAYOUT, 2, 5, 4, 2) == 2 * 5 * 32 + 2 * 7 * 32


def test_the_served_engine_gives_a_trace_of_shared_and_written_blocks(tiny_llama):
    loaded = served.load(str(tiny_llama))
    trace, run = record_trace(loaded, paths=4, width=2, prompt=9, generated=8, step_tokens=4, block_size=2, seed=0)
    assert run.error is None and len(trace) == 2 and all(len(s.paths) == 4 for s in trace)
    first = trace[0].paths
    assert all(p.blocks == first[0].blocks and len(p.blocks) == 4 for p in first)  # the prompt, shared
    for step in trace:
        for p in step.paths:
            assert p.step_tokens == 4 and p.blocks_after[:len(p.blocks)] == p.blocks
            assert len(p.blocks_after) == (p.num_tokens + 4 - 1) // 2
    written = {p.blocks_after for p in first}
    assert {p.blocks for p in trace[1].paths} <= written  # the next step's paths continue these
