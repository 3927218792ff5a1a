"""The residency map and the grouped policies' block store, without a model."""

import pytest
import torch

from runtime.offload.block_store import BlockLost, BlockStore
from runtime.offload.names import BlockNames
from runtime.offload.residency import Residency
from storage.host_tier import HostTier
from storage.kv_cache import KVCache, KVShape
from storage.tiers import TierChain, TransferEngine

SHAPE = KVShape(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2)
NBYTES = SHAPE.bytes_per_block(torch.float32)  # 2 * 2 * 1 * 2 * 4 * 4 = 128


def test_residency_hands_out_slots_in_order_and_evicts_least_recently_used_first():
    r = Residency(3)
    assert [r.assign(k) for k in "abc"] == [0, 1, 2]
    assert r.assign("d") is None  # full
    r.unpin(["b", "a", "c"])  # released in this order: b is least recently used
    assert r.victims(2, protect=set()) == ["b", "a"]
    assert r.victims(2, protect={"b"}) == ["a", "c"]
    r.pin(["b"])
    assert r.victims(3, protect=set()) == ["a", "c"]
    assert r.release("a") == 0 and r.assign("d") == 0
    r.dirty.add("d")
    r.check_integrity()
    r.release("d")
    assert "d" not in r.dirty
    r.limit = 1
    assert r.num_obtainable(protect=set()) == 1  # "c" is evictable, no room beyond the limit
    r.check_integrity()


def make_store(num_slots: int, host_blocks: int = 8) -> BlockStore:
    cache = KVCache(SHAPE, num_slots, torch.float32, torch.device("cpu"))
    chain = TierChain(HostTier(SHAPE.block_shape, torch.float32, host_blocks * NBYTES, name="host"),
                      None, compute_name="compute")
    return BlockStore(cache, chain, TransferEngine(chain), BlockNames(b"test"))


def fill(store: BlockStore, key, value: float) -> None:
    store.cache.kv[store.slot(key)] = value


def moved(store: BlockStore) -> dict[str, int]:
    return {pair: n for pair, n in store.chain.bytes_moved.items() if n}


def test_dirty_blocks_are_written_back_once_and_reloaded_intact():
    store = make_store(2)
    for key, value in ((10, 1.0), (11, 2.0)):
        store.create(key, {key})
        fill(store, key, value)
    store.release([10, 11])
    store.create(12, {12})  # evicts 10, the least recently used, writing it back
    assert not store.is_present(10) and store.is_present(11)
    assert moved(store) == {"compute/host": NBYTES}
    store.release([12])
    store.acquire([10], {10})  # evicts 11 (dirty: written back), loads 10
    assert torch.all(store.cache.kv[store.slot(10)] == 1.0)
    assert moved(store) == {"compute/host": 2 * NBYTES, "host/compute": NBYTES}
    store.release([10])
    store.drop([10])  # clean and below compute already: dropped without a write
    assert moved(store) == {"compute/host": 2 * NBYTES, "host/compute": NBYTES}
    store.check_integrity()
    store.close()


def test_prefetch_fills_only_the_headroom_and_acquire_waits_for_it():
    store = make_store(3)
    for key in (1, 2, 3):
        store.create(key, {key})
        fill(store, key, float(key))
    store.release([1, 2, 3])
    store.drop([1, 2])  # written back; slots free
    store.acquire([3], {3})
    issued = store.prefetch([1, 2], protect={3})
    assert issued == [1, 2] and store.bytes_prefetched == 2 * NBYTES
    store.acquire([1, 2], {1, 2, 3})
    assert torch.all(store.cache.kv[store.slot(2)] == 2.0)
    assert store.prefetch([4], protect={1, 2, 3}) == []  # no headroom left
    store.check_integrity()
    store.close()


def test_forgotten_blocks_leave_every_tier():
    store = make_store(1)
    store.create(7, {7})
    store.release([7])
    store.create(8, {8})  # 7 is written back
    name = store.names.of(7)
    assert store.chain.lookup(name) == "host"
    store.forget([7])
    assert store.chain.lookup(name) is None
    store.release([8])
    with pytest.raises(BlockLost):
        store.acquire([7], {7})  # a dead block's name is new: nothing holds it
    store.close()
