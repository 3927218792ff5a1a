"""The prefix cache over lower tiers: demotion on eviction, promotion on admission, restarts."""

import os
import stat

from runtime.bootstrap import build_engine
from runtime.wire.options import RuntimeOptions
from storage.block_hash import hash_blocks
from tests.runtime.engine_helpers import hf_greedy, request, run

PROMPT = [1] + list(range(5, 36))  # 32 tokens: 8 full blocks of 4 (7 cacheable)


def tiered_engine(path, tmp_path, host_blocks=0, num_blocks=24):
    engine, _ = build_engine(RuntimeOptions(model=str(path), device="cpu", num_blocks=num_blocks, block_size=4,
                                            batch_invariant=True,
                                            host_kv_memory_bytes=host_blocks * 2 * 2 * 2 * 4 * 16 * 4,
                                            disk_kv_dir=str(tmp_path / "kv")))
    return engine


def churn(engine, count=6):
    """Other prompts that push the first prompt's blocks out of the compute tier."""
    for i in range(count):
        run(engine, [request(f"churn{i}", [1] + [40 + i] * 20, max_tokens=2)])


def test_evicted_prefix_comes_back_from_the_host_tier(tiny_llama, tmp_path):
    engine = tiered_engine(tiny_llama, tmp_path, host_blocks=64)
    first = run(engine, [request("a", PROMPT, max_tokens=4)])["a"]
    churn(engine)
    names = hash_blocks(PROMPT[:28], 4, engine.kv.extra_key)
    assert all(engine.pool.lookup(h) is None for h in names)  # all pushed out of the compute tier
    engine.residency.drain()
    assert all(engine.residency.chain.lookup(h) == "host" for h in names)
    moved = engine.residency.chain.bytes_moved
    assert moved["cpu/host"] > 0 and moved["cpu/host"] % engine.cache.bytes_per_block == 0
    again = run(engine, [request("b", PROMPT, max_tokens=4)])["b"]
    assert again["finished"].cached_tokens == 28  # 7 blocks promoted back and hit
    assert again["choices"][0] == first["choices"][0]
    assert engine.residency.chain.bytes_moved["host/cpu"] == 7 * engine.cache.bytes_per_block
    engine.check_integrity()
    engine.residency.chain.check_integrity()


def test_prefix_cache_survives_a_restart_through_the_disk_tier(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    engine = tiered_engine(tiny_llama, tmp_path)
    first = run(engine, [request("a", PROMPT, max_tokens=5)])["a"]
    engine.close()
    directory = tmp_path / "kv"
    files = [p for p in directory.rglob("*") if p.is_file()]
    assert files and all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in files)
    assert all(stat.S_IMODE(os.stat(d).st_mode) == 0o700 for d in [directory, *[p for p in directory.rglob("*")
                                                                                   if p.is_dir()]])
    restarted = tiered_engine(tiny_llama, tmp_path)
    second = run(restarted, [request("b", PROMPT, max_tokens=5)])["b"]
    assert second["finished"].cached_tokens == 28
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    assert second["choices"][0] == first["choices"][0] == hf_greedy(reference, PROMPT, 5)


def test_a_corrupt_disk_block_is_recomputed_never_served(tiny_llama, tmp_path):
    engine = tiered_engine(tiny_llama, tmp_path)
    first = run(engine, [request("a", PROMPT, max_tokens=5)])["a"]
    engine.close()
    for group in (tmp_path / "kv").rglob("*"):
        if group.is_file() and group.name != "index.json":
            data = bytearray(group.read_bytes())
            data[len(data) // 2] ^= 0xFF
            group.write_bytes(bytes(data))
    restarted = tiered_engine(tiny_llama, tmp_path)
    second = run(restarted, [request("b", PROMPT, max_tokens=5)])["b"]
    assert second["finished"].cached_tokens < 28  # the corrupt block and those after it were recomputed
    assert second["choices"][0] == first["choices"][0]


def test_a_full_disk_disables_spilling_and_requests_still_succeed(tiny_llama, tmp_path, monkeypatch, caplog):
    import errno

    import storage.disk_tier as disk_tier

    def no_space(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier, "_write_all", no_space)
    engine = tiered_engine(tiny_llama, tmp_path, num_blocks=12)  # small: evictions spill to disk at once
    results = run(engine, [request(f"r{i}", [1] + [10 + i] * 30, max_tokens=3) for i in range(4)])
    engine.close()
    assert all(len(r["choices"][0]) == 3 for r in results.values())
    assert not engine.residency.chain.disk.is_enabled
    assert any("disabl" in record.message.lower() for record in caplog.records)


def test_demotion_leaves_the_engine_loop_and_is_awaited_before_a_lookup(tiny_llama, tmp_path, monkeypatch):
    import threading
    import time

    engine = tiered_engine(tiny_llama, tmp_path, host_blocks=64)
    chain = engine.residency.chain
    threads = set()
    slow_demote = chain.demote

    def demote(block_hash, payload):
        threads.add(threading.current_thread().name)
        time.sleep(0.05)  # a slow disk: the loop must not wait for this, but a lookup must
        slow_demote(block_hash, payload)

    monkeypatch.setattr(chain, "demote", demote)
    first = run(engine, [request("a", PROMPT, max_tokens=4)])["a"]
    churn(engine)
    assert threads and all(name.startswith("kv-transfer") for name in threads)
    again = run(engine, [request("b", PROMPT, max_tokens=4)])["b"]
    assert again["finished"].cached_tokens == 28  # every demoted block was found, however slow
    assert again["choices"][0] == first["choices"][0]
    engine.close()


def test_finished_demotions_are_not_held_without_lookups(tiny_llama, tmp_path):
    engine = tiered_engine(tiny_llama, tmp_path, host_blocks=512)
    tiers = engine.residency
    for i in range(300):
        tiers._demote(i % engine.config.num_blocks, i.to_bytes(16, "little"))
        if i == 255:
            tiers.transfers.offload(b"x" * 16, engine.cache.read_block(0)).result()  # the queue before it is done
    assert len(tiers._in_flight) <= 300 - 256 + 1
    tiers.drain()
    assert not tiers._in_flight and tiers.chain.host.num_blocks == 301
    engine.close()
