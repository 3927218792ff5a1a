import pytest

from storage.block_hash import hash_block, hash_blocks
from storage.block_pool import BlockPool


def test_allocate_takes_free_blocks_in_order_and_fails_cleanly():
    pool = BlockPool(4, 2)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    assert pool.allocate(2) is None
    assert (pool.num_free, pool.num_cached, pool.num_used) == (1, 0, 3)
    pool.check_integrity([[0, 1, 2]])


def test_release_of_hashed_block_caches_it_and_lookup_finds_it():
    pool = BlockPool(4, 2)
    a, b = pool.allocate(2)
    h = hash_block(None, [1, 2])
    assert pool.register(a, h)
    pool.release([b, a])
    assert (pool.num_free, pool.num_cached, pool.num_used) == (3, 1, 0)
    assert pool.lookup(h) == a
    pool.acquire([a])  # a prefix hit revives a cached block
    assert pool.ref_counts[a] == 1 and pool.num_cached == 0
    pool.check_integrity([[a]])


def test_cached_blocks_are_reclaimed_least_recently_released_first():
    pool = BlockPool(3, 1)
    blocks = pool.allocate(3)
    hashes = [hash_block(None, [i]) for i in range(3)]
    for block, h in zip(blocks, hashes):
        pool.register(block, h)
    pool.release([2])
    pool.release([0])
    pool.release([1])
    evicted = []
    pool.on_evict = lambda block_id, h: evicted.append(block_id)
    assert pool.allocate(2) == [2, 0]
    assert evicted == [2, 0]
    assert pool.lookup(hashes[2]) is None and pool.lookup(hashes[1]) == 1
    assert pool.num_evictions == 2
    pool.check_integrity([[2], [0]])


def test_register_keeps_the_first_writer_of_a_name():
    pool = BlockPool(2, 1)
    a, b = pool.allocate(2)
    h = hash_block(None, [7])
    assert pool.register(a, h)
    assert not pool.register(b, h)
    pool.release([a, b])
    assert (pool.num_cached, pool.num_free) == (1, 1)
    pool.check_integrity([])


def test_double_release_and_sharing_a_free_block_raise():
    pool = BlockPool(2, 1)
    (a,) = pool.allocate(1)
    pool.release([a])
    with pytest.raises(ValueError):
        pool.release([a])
    with pytest.raises(ValueError):
        pool.acquire([a])


def test_integrity_check_catches_wrong_refcounts():
    pool = BlockPool(2, 1)
    pool.allocate(1)
    with pytest.raises(AssertionError):
        pool.check_integrity([[0], [0]])


def test_chained_hashes_depend_on_parent_and_extra_key():
    tokens = list(range(8))
    chain = hash_blocks(tokens, 4)
    assert len(chain) == 2 and chain[1] == hash_block(chain[0], tokens[4:8])
    assert hash_blocks(tokens, 4, b"other-model") != chain
    assert hash_blocks(tokens[:7], 4) == chain[:1]  # partial blocks have no name
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0]), [1, 2])
