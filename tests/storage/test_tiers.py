import threading
import time

import pytest
import torch

from storage.block_hash import hash_block
from storage.disk_tier import DiskTier
from storage.host_tier import HostTier
from storage.tiers import TierChain, TransferEngine, piece_key

SHAPE = (2, 2, 2, 4, 8)  # layers, K/V, kv heads, block size, head dim
NBYTES = 512  # float16


def name(i: int) -> bytes:
    return hash_block(None, [i], b"test")


def payload(i: int) -> torch.Tensor:
    return (torch.arange(256) + 1000 * i).reshape(SHAPE).to(torch.float16)


def host(num_blocks: int, **kw) -> HostTier:
    return HostTier(SHAPE, torch.float16, num_blocks * NBYTES + NBYTES - 1, **kw)


def disk(root, **kw) -> DiskTier:
    return DiskTier(root, "tiny|float16|L2H2D8B4", kw.pop("capacity_bytes", 64 * NBYTES),
                    blocks_per_group=2, **kw)


def moved(chain: TierChain) -> dict[str, int]:
    return {pair: n for pair, n in chain.bytes_moved.items() if n}


# ---- host tier -------------------------------------------------------------------------------

def test_host_tier_capacity_comes_from_the_byte_budget():
    tier = host(3, pin_memory=True)
    assert tier.block_nbytes == NBYTES and tier.num_slots == 3 and tier.capacity_bytes == 3 * NBYTES
    assert tier.is_pinned == torch.cuda.is_available()
    assert HostTier(SHAPE, torch.float32, 4 * NBYTES).num_slots == 2


def test_host_tier_evicts_least_recently_used_first_and_returns_owned_copies():
    tier = host(3)
    for i in range(3):
        assert tier.put(name(i), payload(i)) == []
    assert torch.equal(tier.get(name(0)), payload(0))  # 0 becomes the most recently used
    assert tier.lru_order() == [name(1), name(2), name(0)]
    [(evicted_hash, evicted)] = tier.put(name(3), payload(3))
    assert evicted_hash == name(1)
    assert torch.equal(evicted, payload(1))  # a copy: the slot now holds block 3
    assert torch.equal(tier.get(name(3)), payload(3))
    assert tier.put(name(2), payload(2)) == []  # already held: only marked used
    assert tier.lru_order() == [name(0), name(3), name(2)]
    assert tier.used_bytes == 3 * NBYTES
    assert tier.discard(name(0)) and not tier.discard(name(0)) and tier.get(name(0)) is None
    assert tier.put(name(4), payload(4)) == []  # the discarded slot is reused
    tier.check_integrity()


def test_host_tier_copies_in_and_rejects_other_shapes():
    tier = host(1)
    source = payload(0)
    tier.put(name(0), source)
    source.zero_()
    assert torch.equal(tier.get(name(0)), payload(0))
    with pytest.raises(ValueError):
        tier.put(name(1), torch.zeros((1, *SHAPE[1:]), dtype=torch.float16))
    with pytest.raises(ValueError):
        tier.put(name(1), payload(1).float())


def test_a_host_tier_without_room_hands_every_block_back():
    tier = HostTier(SHAPE, torch.float16, NBYTES - 1)
    p = payload(0)
    [(h, back)] = tier.put(name(0), p)
    assert h == name(0) and back is p and tier.num_blocks == 0
    tier.check_integrity()


# ---- tier chain ------------------------------------------------------------------------------

def test_demotion_cascades_host_to_disk_and_counts_bytes(tmp_path):
    chain = TierChain(host(2), disk(tmp_path))
    for i in range(3):
        chain.demote(name(i), payload(i))
    assert moved(chain) == {"gpu/cpu": 3 * NBYTES, "cpu/disk": NBYTES}
    assert set(chain.bytes_moved) == {"gpu/cpu", "gpu/disk", "cpu/gpu", "cpu/disk", "disk/gpu",
                                      "disk/cpu"}
    assert [chain.lookup(name(i)) for i in range(4)] == ["disk", "cpu", "cpu", None]
    chain.demote(name(2), payload(2))  # already held: nothing moves
    assert moved(chain) == {"gpu/cpu": 3 * NBYTES, "cpu/disk": NBYTES}
    chain.check_integrity()


def test_a_disk_hit_is_promoted_to_host_and_pushes_the_oldest_host_block_down(tmp_path):
    chain = TierChain(host(2), disk(tmp_path))
    for i in range(3):
        chain.demote(name(i), payload(i))
    got = chain.fetch(name(0))
    assert torch.equal(got, payload(0))
    assert moved(chain) == {"gpu/cpu": 3 * NBYTES, "cpu/disk": 2 * NBYTES, "disk/cpu": NBYTES,
                            "cpu/gpu": NBYTES}
    assert [chain.lookup(name(i)) for i in range(3)] == ["cpu", "disk", "cpu"]
    chain.demote(name(2), payload(2))
    chain.demote(name(5), payload(5))  # evicts block 0 from host; disk already holds it
    assert chain.lookup(name(0)) == "disk"
    assert moved(chain)["cpu/disk"] == 2 * NBYTES
    chain.check_integrity()


def test_fetch_without_promotion_serves_straight_from_disk(tmp_path):
    chain = TierChain(host(1), disk(tmp_path), promote_disk_hits=False)
    chain.demote(name(0), payload(0))
    chain.demote(name(1), payload(1))
    assert torch.equal(chain.fetch(name(0)), payload(0))
    assert moved(chain) == {"gpu/cpu": 2 * NBYTES, "cpu/disk": NBYTES, "disk/gpu": NBYTES}
    assert chain.lookup(name(0)) == "disk"


def test_fetch_into_a_compute_slot_and_owned_results(tmp_path):
    chain = TierChain(host(2), None)
    chain.demote(name(0), payload(0))
    kv = torch.zeros((4, *SHAPE), dtype=torch.float16)  # a stand-in compute pool
    assert chain.fetch(name(0), out=kv[2]) is not None
    assert torch.equal(kv[2], payload(0)) and not kv[1].any()
    owned = chain.fetch(name(0))
    owned.zero_()  # must not reach the host copy
    assert torch.equal(chain.fetch(name(0)), payload(0))
    assert chain.fetch(name(9)) is None
    assert moved(chain) == {"gpu/cpu": NBYTES, "cpu/gpu": 3 * NBYTES}


def test_chains_without_a_host_or_a_disk_tier(tmp_path):
    no_disk = TierChain(host(1), None)
    no_disk.demote(name(0), payload(0))
    no_disk.demote(name(1), payload(1))
    assert [no_disk.lookup(name(i)) for i in range(2)] == [None, "cpu"]
    only_disk = TierChain(None, disk(tmp_path / "a", capacity_bytes=2 * NBYTES))
    for i in range(3):
        only_disk.demote(name(i), payload(i))
    assert [only_disk.lookup(name(i)) for i in range(3)] == [None, None, "disk"]
    assert moved(only_disk) == {"gpu/disk": 3 * NBYTES}
    assert torch.equal(only_disk.fetch(name(2)), payload(2))
    nothing = TierChain(None, None)
    nothing.demote(name(0), payload(0))
    assert nothing.lookup(name(0)) is None and nothing.fetch(name(0)) is None
    assert nothing.bytes_moved == {}


def test_a_full_disk_disables_spilling_without_raising(tmp_path, monkeypatch, caplog):
    import errno
    import os

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    chain = TierChain(host(1), disk(tmp_path))
    monkeypatch.setattr(os, "write", full)
    chain.demote(name(0), payload(0))
    chain.demote(name(1), payload(1))  # block 0 goes to the disk's pending group
    chain.demote(name(2), payload(2))  # block 1 fills the group, whose write fails
    chain.demote(name(3), payload(3))  # block 2 finds spilling disabled
    assert "spilling disabled" in caplog.text
    assert moved(chain) == {"gpu/cpu": 4 * NBYTES, "cpu/disk": NBYTES}
    assert [chain.lookup(name(i)) for i in range(4)] == [None, None, None, "cpu"]
    chain.check_integrity()


def test_compute_residency_comes_from_the_callback(tmp_path):
    resident = {name(7)}
    chain = TierChain(host(1), None, compute_name="device",
                      is_compute_resident=resident.__contains__)
    assert chain.lookup(name(7)) == "device"
    chain.demote(name(0), payload(0))
    assert chain.bytes_moved["device/cpu"] == NBYTES
    with pytest.raises(ValueError):
        TierChain(HostTier(SHAPE, torch.float16, 0, name="gpu"), None)


def test_head_group_pieces_round_trip_through_the_tiers(tmp_path):
    block = payload(3)  # [layers, 2, heads, block size, head dim]
    piece_shape = (2, 1, 4, 8)  # one layer, K and V, one head
    chain = TierChain(HostTier(piece_shape, torch.float16, 2 * 128), disk(tmp_path))
    for layer in range(2):
        for head in range(2):
            chain.demote(piece_key(name(3), layer, head), block[layer, :, head:head + 1])
    rebuilt = torch.zeros_like(block)
    for layer in range(2):
        for head in range(2):
            assert chain.fetch(piece_key(name(3), layer, head),
                               out=rebuilt[layer, :, head:head + 1]) is not None
    assert torch.equal(rebuilt, block)
    assert len(piece_key(name(3), 1, 1)) == 20
    assert piece_key(name(3), 1, 0) != piece_key(name(3), 0, 1)


# ---- transfer engine -------------------------------------------------------------------------

def test_prefetch_waits_per_block_and_finished_blocks_cost_no_stall(tmp_path):
    chain = TierChain(host(2), disk(tmp_path))
    for i in range(4):
        chain.demote(name(i), payload(i))
    engine = TransferEngine(chain)
    handle = engine.prefetch([name(0), name(3), name(9), name(0)])
    assert handle.hashes == [name(0), name(3), name(9)]
    deadline = time.monotonic() + 10
    while not all(handle.is_ready(h) for h in handle.hashes) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert torch.equal(handle.wait(name(0)), payload(0))
    assert torch.equal(handle.wait(name(3)), payload(3))
    assert handle.wait(name(9)) is None
    assert engine.stall_seconds == 0.0
    engine.close()
    chain.check_integrity()


def test_time_blocked_in_wait_is_counted_as_stall():
    chain = TierChain(host(2), None)
    chain.demote(name(0), payload(0))
    gate = threading.Event()
    fetch = chain.fetch

    def slow_fetch(block_hash, out=None):
        gate.wait(10)
        return fetch(block_hash, out)

    chain.fetch = slow_fetch
    engine = TransferEngine(chain)
    kv = torch.zeros((2, *SHAPE), dtype=torch.float16)
    handle = engine.prefetch([name(0)], out={name(0): kv[1]})
    assert not handle.is_ready(name(0))
    threading.Timer(0.2, gate.set).start()
    assert handle.wait(name(0)) is not None
    assert torch.equal(kv[1], payload(0))
    assert 0.1 <= engine.stall_seconds < 10
    engine.close()


def test_offload_copies_at_once_and_runs_before_later_prefetches(tmp_path):
    chain = TierChain(host(1), disk(tmp_path))
    engine = TransferEngine(chain)
    kv = torch.stack([payload(0), payload(1)])
    first = engine.offload(name(0), kv[0])
    second = engine.offload(name(1), kv[1])
    kv.zero_()  # the compute pool reuses the slots at once
    handle = engine.prefetch([name(0), name(1)])
    assert torch.equal(handle.wait(name(0)), payload(0))
    assert torch.equal(handle.wait(name(1)), payload(1))
    assert first.result() is None and second.done()
    engine.close()
    assert moved(chain) == {"gpu/cpu": 2 * NBYTES, "cpu/disk": 2 * NBYTES, "disk/cpu": 2 * NBYTES,
                            "cpu/gpu": 2 * NBYTES}
    chain.check_integrity()
