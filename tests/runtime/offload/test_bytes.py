"""Exact bytes moved between tiers, for cases small enough to count by hand.

The tiny llama has 2 layers, 2 KV heads of dimension 16; with 4-token blocks in float32 a block is
2 (K/V) * 2 layers * 2 heads * 4 tokens * 16 * 4 bytes = 2048 bytes and a layer piece 1024.
Prompts of 8 tokens and 4-token steps keep every fork on a block boundary.
"""

from .helpers import run, spec

BLOCK = 2048
PIECE = 1024
PROMPT = (5, 9, 13, 17, 21, 25, 29, 33)


def moved(report) -> dict[str, int]:
    return {pair: n for pair, n in report.bytes_moved.items() if n}


def test_layerwise_reloads_every_full_block_of_every_beam_per_token_and_layer(model):
    # 2 beams, width 2, 2 steps of 4 tokens, a budget of 4 blocks = 8 layer pieces.
    report = run(model, spec(prompt_ids=PROMPT, num_beams=2, step_tokens=4, num_steps=2), "token", 4)
    assert report.block_bytes == BLOCK
    # Step 1 (positions 8-11): each beam spans 3 blocks, P = 6 pieces a layer, so Eq. 1 keeps
    # L = 8 // 6 = 1 layer. Layer 1 of the 2 prompt blocks is written back when L falls (2 pieces);
    # each token reloads layer 1 of each beam's 2 full blocks (4 pieces, the shared prompt once
    # per beam): 4 tokens * 4 = 16. The 2 blocks filled at position 11 are written back (2).
    # Step 2 (positions 12-15), both beams forked from the better one: 4 blocks each, P = 8,
    # L = 1; 4 tokens * 2 beams * 3 full blocks = 24 pieces in; 2 filled blocks written back.
    assert report.resident_layers == (1, 1)
    assert moved(report) == {"host/compute": (16 + 24) * PIECE, "compute/host": (2 + 2 + 2) * PIECE}
    assert report.bytes_prefetched == report.bytes_in


def test_beam_groups_without_prefix_sharing_reload_every_beam_every_step(model):
    # 4 beams, 3 steps of 4 tokens, 6 blocks. Every beam loads all its blocks at each step
    # (the paper's Eq. 5): 4 beams * (2 + 3 + 4) blocks. Written back: the prompt after the
    # prefill (2 blocks) and every beam's new block when its group ends (4 beams * 3 steps).
    report = run(model, spec(prompt_ids=PROMPT, num_beams=4, step_tokens=4, num_steps=3),
                 "lbs_no_prefix", 6)
    assert moved(report) == {"host/compute": 4 * (2 + 3 + 4) * BLOCK,
                             "compute/host": (2 + 4 * 3) * BLOCK}
    # Step 1: 3 blocks a beam, 2 beams a group; steps 2 and 3: 4 and 5 blocks, one beam a group.
    assert report.group_sizes == ((2, 2), (1, 1, 1, 1), (1, 1, 1, 1))
    assert report.group_blocks == ((6, 6), (4, 4, 4, 4), (5, 5, 5, 5))


def test_beam_groups_with_prefix_sharing_keep_shared_blocks_resident(model):
    # 2 beams, 2 steps, 4 blocks. Step 1: the prompt's 2 blocks are shared, so both beams and
    # their new blocks fit in one group (2 + 1 + 1). Step 2: the children share 3 blocks and need
    # one new block each, 5 > 4, so they run one after the other; the second evicts the first
    # one's new block, the only copy it may evict, and writes it back. Nothing is ever loaded.
    report = run(model, spec(prompt_ids=PROMPT, num_beams=2, step_tokens=4, num_steps=2), "lbs", 4)
    assert report.group_sizes == ((2,), (1, 1))
    assert moved(report) == {"compute/host": BLOCK}
    assert report.max_resident_blocks == 4
