"""The engine loop checks a real engine's invariants each time it runs out of work, and that check
covers every part that keeps blocks: the compute pool's refcounts and its prefix-cache hash map, the
host and disk tiers below it, and each reward model's pool. Each case breaks one of them after the
last step and before the loop goes idle."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from runtime import process
from runtime.bootstrap import build_engine
from runtime.wire.protocol import Finished
from runtime.wire.options import RuntimeOptions
from tests.runtime.engine_helpers import request


def break_ref_count(engine) -> None:
    engine.pool.ref_counts[0] += 1  # a block nobody holds


def break_hash_map(engine) -> None:
    (block_hash, block_id), *_ = engine.pool.hash_to_block.items()
    engine.pool.hash_to_block[block_hash] = (block_id + 1) % engine.pool.num_blocks


def break_host_tier(engine) -> None:
    engine.residency.chain.host._free_slots.pop()  # a slot neither free nor used


def break_disk_tier(engine) -> None:
    engine.residency.chain.disk._used_bytes += 1  # bytes no group file holds


def break_verifier_pool(engine) -> None:
    engine.verifier_stores[0].pool.ref_counts[0] += 1


class BreakingChannel:
    """Records what the loop sends; once the request has finished, `corrupt` breaks the engine; the
    loop ends when it goes back to waiting."""

    def __init__(self, engine, corrupt) -> None:
        self.engine = engine
        self.corrupt = corrupt
        self.sent: list = []

    def send(self, message) -> None:
        self.sent.append(message)
        if isinstance(message, Finished) and self.corrupt is not None:
            self.corrupt(self.engine)

    def send_all(self, messages) -> None:
        for message in messages:
            self.send(message)

    def poll(self, timeout: float) -> bool:
        if not self.engine.has_work:
            raise process.Stop()
        return False


@pytest.mark.parametrize("corrupt, reason", [
    (None, None),
    (break_ref_count, "a referenced block is on the free or cached list"),
    (break_hash_map, "hash map and block names disagree"),
    (break_host_tier, "!= slots"),
    (break_disk_tier, "!= files"),
    (break_verifier_pool, "a referenced block is on the free or cached list"),
])
def test_the_idle_check_covers_pool_prefix_cache_tiers_and_verifier_pools(tiny_llama, causal_lm_dir, tmp_path,
                                                                           caplog, corrupt, reason):
    engine, _ = build_engine(RuntimeOptions(
        model=str(tiny_llama), device="cpu", num_blocks=64, block_size=4, batch_invariant=True,
        host_kv_memory_bytes=1 << 20, disk_kv_dir=str(tmp_path / "kv"),
        verifiers={"shepherd": {"kind": "math-shepherd", "path": str(causal_lm_dir)}},
        verifier_kv_memory_bytes=1 << 20))
    engine.add_request(request("a", [1] + list(range(5, 28)), max_tokens=4))
    channel = BreakingChannel(engine, corrupt)
    with pytest.raises(process.Stop), caplog.at_level("ERROR", logger="ponder.runtime"):
        process._loop(channel, engine, SimpleNamespace(stats_interval_s=1e9))
    assert any(isinstance(m, Finished) for m in channel.sent)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    if reason is None:
        assert errors == []
    else:
        assert len(errors) == 1 and errors[0].startswith("the engine's integrity check failed when idle: ")
        assert reason in errors[0]
