"""The sliding layers' blocks (scheduler.sliding_window): released when, and only when, they leave the
window of the next token; shared by forks and copied on write; a prefix hit only as far as the window
before it is still held."""

from __future__ import annotations

from scheduler.kv_manager import KVManager
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from scheduler.sliding_window import SlidingWindow
from storage.block_pool import BlockPool

WINDOW = 6  # a query at p reads (p - 6, p]: positions p - 5 .. p


def make(num_blocks=8, num_window_blocks=5, block_size=4, prefix_cache=True):
    pool, window_pool = BlockPool(num_blocks, block_size), BlockPool(num_window_blocks, block_size)
    return KVManager(pool, enable_prefix_cache=prefix_cache, window=SlidingWindow(window_pool, WINDOW))


def counts(pool):
    return pool.num_used, pool.num_cached, pool.num_free


def check(kv, *seqs):
    kv.pool.check_integrity([s.block_table for s in seqs])
    kv.window.check_integrity(list(seqs))


def grow(kv, seq, token):
    seq.append_token(token)
    allocation = kv.append_slots(seq, 1)
    kv.commit_computed(seq, len(seq.token_ids))
    return allocation


def test_the_first_block_is_the_one_holding_the_window_s_first_position():
    window = SlidingWindow(BlockPool(4, 4), WINDOW)
    assert [window.first_block(p) for p in range(14)] == [0] * 9 + [1] * 4 + [2]


def test_a_block_is_released_when_and_only_when_it_leaves_the_next_token_s_window():
    kv = make()
    seq = Sequence(list(range(10)))
    assert kv.admit(seq, 100)
    assert seq.block_table == [0, 1, 2] and seq.window_table == [0, 1, 2]
    kv.commit_computed(seq, 10)  # the next query, at 10, reads 5 .. 10: blocks 1 and 2
    assert seq.window_table == [None, 1, 2] and counts(kv.window.pool) == (2, 1, 2)
    assert kv.window.pool.block_hashes[0] == seq.block_hashes[0]  # named before it went: cached
    check(kv, seq)
    grow(kv, seq, 10)  # the next query, at 11, reads 6 .. 11
    grow(kv, seq, 11)  # at 12: 7 .. 12, position 7 still in block 1
    assert seq.window_table == [None, 1, 2] and counts(kv.window.pool) == (2, 1, 2)
    allocation = grow(kv, seq, 12)  # at 13: 8 .. 13, block 1 leaves; block 3 holds 12 ..
    assert allocation.copies == [] and allocation.window_copies == []
    assert seq.block_table == [0, 1, 2, 3] and seq.window_table == [None, None, 2, 3]
    assert counts(kv.window.pool) == (2, 2, 1) and counts(kv.pool) == (4, 0, 4)
    check(kv, seq)
    kv.free(seq)
    assert counts(kv.window.pool) == (0, 3, 2) and counts(kv.pool) == (0, 3, 5)
    check(kv)


def test_admission_counts_both_pools_and_takes_nothing_from_either_when_one_is_short():
    kv = make(num_blocks=8, num_window_blocks=2, prefix_cache=False)
    seq = Sequence(list(range(10)))
    assert not kv.admit(seq, 100)  # three blocks of each: the window's pool holds two
    assert seq.block_table == [] and seq.window_table == [] and counts(kv.pool) == (0, 0, 8)
    assert kv.admit(seq, 8)  # a first chunk of 8 tokens: two blocks of each
    assert (seq.block_table, seq.window_table) == ([0, 1], [0, 1])
    kv.commit_computed(seq, 8)  # the query at 8 reads 3 .. 8: block 0 still
    assert not kv.can_append(seq, 2) and kv.append_slots(seq, 2) is None
    assert counts(kv.window.pool) == (2, 0, 0)
    assert kv.num_free == 0 and kv.pool.num_free == 6  # (speculation's idle slots: the fewer)
    check(kv, seq)


def test_a_long_prompt_needs_only_its_window_in_the_sliding_pool():
    """A prompt of 40 tokens in chunks of 8: 10 blocks of the full layers, never more than 4 of the window's."""
    kv = make(num_blocks=10, num_window_blocks=4, prefix_cache=False)
    scheduler = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=8)
    seq = Sequence(list(range(40)))
    scheduler.add(seq)
    held = []
    while seq.num_computed_tokens < 40:
        out = scheduler.schedule()
        assert [s.num_new_tokens for s in out.scheduled] == [8] and not out.preempted
        held.append(kv.window.pool.num_used)
        kv.commit_computed(seq, seq.num_computed_tokens + 8)
        check(kv, seq)
    assert held == [2, 4, 4, 4, 4]
    assert seq.window_table[:8] == [None] * 8 and None not in seq.window_table[8:]  # the query at 40 reads 35 ..
    assert counts(kv.pool) == (10, 0, 0) and counts(kv.window.pool) == (2, 0, 2)


def test_a_fork_shares_the_window_s_blocks_and_copies_the_partial_one_on_write():
    kv = make()
    parent = Sequence(list(range(14)))
    assert kv.admit(parent, 100)
    kv.commit_computed(parent, 14)  # reads 9 .. 14: blocks 2 and 3
    assert parent.window_table == [None, None, 2, 3]
    child = Sequence(list(parent.token_ids), parent.num_prompt_tokens)
    kv.fork(parent, child)
    assert child.block_table == [0, 1, 2, 3] and child.window_table == [None, None, 2, 3]
    assert kv.window.pool.ref_counts == [0, 0, 2, 2, 0] and kv.pool.ref_counts[:4] == [2, 2, 2, 2]
    check(kv, parent, child)
    parent.append_token(90)
    child.append_token(91)
    allocation = kv.append_slots(parent, 1)  # block 3 holds 12, 13: shared, so the parent copies it
    assert allocation.copies == [(3, 4)] and allocation.window_copies == [(3, 4)]  # (0 and 1 are cached)
    assert parent.window_table == [None, None, 2, 4]
    allocation = kv.append_slots(child, 1)  # the child is now block 3's only holder
    assert allocation.copies == [] and allocation.window_copies == []
    kv.commit_computed(parent, 15)
    kv.commit_computed(child, 15)
    assert kv.window.pool.ref_counts == [0, 0, 2, 1, 1]
    check(kv, parent, child)


def test_a_fork_cut_behind_the_released_window_shares_what_the_pool_still_names_or_takes_nothing():
    kv = make()
    parent = Sequence(list(range(14)))
    kv.admit(parent, 100)
    kv.commit_computed(parent, 14)  # window blocks 0 and 1 released, named: cached
    near = Sequence(list(range(11)))  # computed 10: reads 5 .. 10, blocks 1 and 2; 1 found by its name
    kv.fork(parent, near, 11)
    assert near.num_computed_tokens == 10 and near.window_table == [None, 1, 2] and near.block_table == [0, 1, 2]
    assert kv.window.pool.ref_counts == [0, 1, 2, 1, 0]  # (the parent and near hold block 2)
    within = Sequence(list(range(14)))  # computed 13: reads 8 .. 13, blocks 2 and 3
    kv.fork(parent, within, 14)
    assert within.num_computed_tokens == 13 and within.window_table == [None, None, 2, 3]
    check(kv, parent, near, within)
    kv.free(near)
    kv.window.pool.forget_name(1)  # the pool lost block 1's contents: a cut that reads it takes nothing
    lost = Sequence(list(range(13)))  # computed 12: reads 7 .. 12, blocks 1 .. 3
    kv.fork(parent, lost, 13)
    assert (lost.block_table, lost.window_table, lost.num_computed_tokens) == ([], [], 0)
    check(kv, parent, within)
    unnamed = make(prefix_cache=False)  # without the prefix cache a released block has no name
    other = Sequence(list(range(14)))
    unnamed.admit(other, 100)
    unnamed.commit_computed(other, 14)
    cut = Sequence(list(range(11)))
    unnamed.fork(other, cut, 11)
    assert (cut.block_table, cut.window_table, cut.num_computed_tokens) == ([], [], 0)
    check(unnamed, other)


def test_a_prefix_hit_counts_only_as_far_as_the_window_before_it_is_held():
    kv = make(num_window_blocks=6)
    first = Sequence(list(range(13)))
    kv.admit(first, 100)
    kv.commit_computed(first, 13)  # blocks 0 .. 2 full and named in both pools; window blocks 0, 1 released
    kv.free(first)
    served = Sequence(list(range(12)) + [70, 71])
    assert kv.admit(served, 100)  # the hit of 12 tokens: the query at 12 reads 7 .. 12, blocks 1 .. 3
    assert served.num_computed_tokens == 12 and served.window_table[0] is None
    named = [kv.window.pool.lookup(h) for h in served.block_hashes]
    assert served.window_table[1:3] == named[1:3]
    kv.free(served)
    check(kv)
    kv.window.pool.forget_name(named[1])  # the window pool lost block 1: the hit ends where it is not read
    shortened = Sequence(list(range(12)) + [70, 71])
    assert kv.admit(shortened, 100)
    assert shortened.num_computed_tokens == 4 and shortened.num_cached_tokens == 4
    assert shortened.window_table[0] == named[0] and len(shortened.window_table) == 4
    assert kv.prefix_stats.hit_tokens == 12 + 4
    check(kv, shortened)
