"""`policy = "token"` with tiers: the paper's layer-wise baseline in the served engine. The tokens
equal a resident run's whatever the budget or tier, the bytes follow Eq. 1/2 exactly, and a disk
piece that fails its checksum is recomputed, never served."""

import pytest

from runtime.kv.layer_offload import resident_layers
from tests.conftest import build_model
from tests.runtime.engine_helpers import engine_for, request, run
from tests.runtime.search.test_search_engine import engine_choices, run_search, search_request
from tests.runtime.search.test_search_scheduling import SEARCH


@pytest.fixture(scope="module")
def expected(tiny_llama):
    engine = engine_for(tiny_llama, num_blocks=1024, scheduler_policy="token", speculative_extension=False)
    return engine_choices(run_search(engine, search_request("resident", **SEARCH)))


@pytest.mark.parametrize("num_blocks, speculative", [(4, False), (8, False), (24, False), (8, True)])
def test_layerwise_offload_gives_the_resident_search(tiny_llama, expected, num_blocks, speculative):
    engine = engine_for(tiny_llama, num_blocks=num_blocks, scheduler_policy="token",
                        speculative_extension=speculative, host_kv_memory_bytes=4 << 20)
    assert engine.pool.num_blocks > num_blocks and engine.residency.budget_blocks == num_blocks
    assert engine_choices(run_search(engine, search_request("offloaded", **SEARCH))) == expected
    engine.residency.pipeline.drain()
    stats = engine.runtime_stats()
    piece = engine.residency.piece_bytes
    assert engine.residency.num_loaded > 0 and engine.stats["preemptions"] == 0
    assert stats.kv_transfer_bytes["host/cpu"] == engine.residency.num_loaded * piece
    assert stats.kv_transfer_bytes["cpu/host"] == engine.residency.num_written * piece
    assert stats.prefetch_stall_seconds > 0


def test_pieces_from_the_disk_tier_give_the_resident_search(tiny_llama, expected, tmp_path):
    engine = engine_for(tiny_llama, num_blocks=8, scheduler_policy="token", speculative_extension=False,
                        disk_kv_dir=str(tmp_path), disk_kv_bytes=8 << 20)
    assert engine_choices(run_search(engine, search_request("disk", **SEARCH))) == expected
    moved = engine.runtime_stats().kv_transfer_bytes
    assert moved["disk/cpu"] == engine.residency.num_loaded * engine.residency.piece_bytes > 0


def test_bytes_follow_eq_1_and_2(tmp_path):
    """One path of a 4-layer model, budget 2 blocks: before each token, L = min(4, 2*4 // P) layers
    stay resident and (4 - L) layers of every full block are loaded; each block, once full, writes
    its offloaded layers back, and a block read when L falls writes back the newly offloaded ones."""
    engine = engine_for(build_model(tmp_path / "m", layers=4), num_blocks=2, scheduler_policy="token",
                        host_kv_memory_bytes=1 << 20, batch_invariant=False)
    prompt, new = list(range(4, 14)), 12  # 10 prompt tokens, 12 generated: 22 tokens of KV at most
    out = run(engine, [request("r", prompt, max_tokens=new)])
    loads = writes = 0
    low: dict[int, int] = {}  # full block -> its lowest offloaded layer
    below: dict[int, int] = {}  # full block -> its lowest layer ever written back
    for start, end in [(0, len(prompt))] + [(p, p + 1) for p in range(len(prompt), len(prompt) + new - 1)]:
        layer_blocks = -(-end // 4)
        first = resident_layers(4, 2, layer_blocks)
        for block in range(start // 4):
            writes += max(0, below[block] - first)  # L fell: each layer is written back once
            below[block] = min(below[block], first)
            loads += max(0, first - low[block])  # L rose: loaded back for good
            low[block] = first
            loads += 4 - first
        for block in range(start // 4, end // 4):
            low[block] = below[block] = first
            writes += 4 - first
    assert first < 4 and loads > 0
    piece = engine.residency.piece_bytes
    engine.residency.pipeline.drain()
    moved = engine.runtime_stats().kv_transfer_bytes
    assert (moved["host/cpu"], moved["cpu/host"]) == (loads * piece, writes * piece)
    assert len(out["r"]["choices"][0]) == new


def test_a_corrupt_disk_piece_is_recomputed_never_served(tiny_llama, expected, tmp_path, caplog):
    engine = engine_for(tiny_llama, num_blocks=4, scheduler_policy="token", speculative_extension=False,
                        disk_kv_dir=str(tmp_path), disk_kv_bytes=8 << 20)
    disk = engine.residency.chain.disk
    messages = []
    assert not isinstance(engine.add_request(search_request("corrupt", **SEARCH))[0], Exception)
    corrupted = False
    while engine.has_work:
        messages += engine.step()
        groups = sorted(disk.path.glob("*.kvg")) if not corrupted else []
        if len(groups) >= 2:  # flip one byte in every piece written so far, reads go to the files
            for path in groups:
                data = bytearray(path.read_bytes())
                for i in range(0, len(data), engine.residency.piece_bytes):
                    data[i] ^= 0xFF
                path.write_bytes(bytes(data))
            disk._reuse.clear()
            corrupted = True
        engine.check_integrity()
    assert corrupted and "checksum mismatch" in caplog.text
    assert engine.residency.num_lost > 0
    assert engine_choices(messages) == expected
