"""Recurrent states beside the paged KV (storage.recurrent_state): which state a step resumes, forks that
share, frees, and the byte-capped block-boundary snapshots."""

import torch

from scheduler.kv_manager import KVManager
from scheduler.sequence import Sequence
from storage.block_pool import BlockPool
from storage.recurrent_state import RecurrentStates, State, prefix_keys

BS = 4


def state(token_ids, num_tokens, nbytes=16):
    _, key = prefix_keys(token_ids, BS, num_tokens)
    return State(num_tokens, key, (torch.zeros(nbytes // 4),))


def test_prefix_keys_chain_block_by_block_and_differ_where_tokens_differ():
    a, b = list(range(10)), list(range(10))
    b[5] = 99
    keys_a, end_a = prefix_keys(a, BS, 10)
    keys_b, end_b = prefix_keys(b, BS, 10)
    assert len(keys_a) == 2 and keys_a[0] == keys_b[0] and keys_a[1] != keys_b[1] and end_a != end_b
    assert prefix_keys(a, BS, 8) == (keys_a, keys_a[1])  # a boundary's key is the prefix's key
    assert prefix_keys(a + [7, 7], BS, 10) == (keys_a, end_a)  # tokens after the end do not count


def test_a_sequence_resumes_its_own_state_only_where_it_covers_exactly_the_tokens_before_the_step():
    states = RecurrentStates(BS, 1 << 20)
    tokens = list(range(10))
    states.store(1, state(tokens, 7))
    assert states.resume(1, tokens, 7).state is states.states[1]
    assert states.resume(1, tokens, 6).state is None  # the state is past the step's start
    assert states.resume(1, tokens[:6] + [50, 51], 7).state is None  # the same count, other tokens
    assert states.resume(2, tokens, 7).state is None  # another sequence's
    assert states.num_resumed_tokens == 6 + 7 + 7


def test_resuming_takes_the_latest_snapshot_at_or_before_the_start():
    states = RecurrentStates(BS, 1 << 20)
    tokens = list(range(20))
    for n in (4, 8, 16):
        states.snapshot(state(tokens, n))
    assert states.resume(9, tokens, 14).num_tokens == 8
    assert states.resume(9, tokens, 16).num_tokens == 16
    assert states.resume(9, tokens, 3).num_tokens == 0
    other = tokens[:6] + [99] + tokens[7:]  # shares the first block only
    assert states.resume(9, other, 14).num_tokens == 4
    assert states.num_resumed_tokens == 6 + 0 + 3 + 10


def test_forks_share_the_parents_state_and_frees_forget_it():
    states = RecurrentStates(BS, 1 << 20)
    pool = BlockPool(16, BS)
    kv = KVManager(pool, states=states)
    parent = Sequence(list(range(9)))
    assert kv.admit(parent, 9)
    kv.commit_computed(parent, 8)
    states.store(parent.seq_id, state(parent.token_ids, 8))
    child, cut = Sequence(parent.token_ids), Sequence(parent.token_ids[:6])
    kv.fork(parent, child)
    kv.fork(parent, cut, 6)
    assert states.states[child.seq_id] is states.states[parent.seq_id]
    assert states.resume(child.seq_id, child.token_ids, 8).state is states.states[parent.seq_id]
    assert states.resume(cut.seq_id, cut.token_ids, cut.num_computed_tokens).state is None  # cut before its end
    for seq in (parent, child, cut):
        kv.free(seq)
    assert states.states == {}
    pool.check_integrity()


def test_snapshots_keep_to_their_byte_cap_least_recently_used_first():
    states = RecurrentStates(BS, 64)
    tokens = list(range(40))
    for n in (4, 8, 12, 16):
        states.snapshot(state(tokens, n, nbytes=16))
    states.resume(0, tokens, 4)  # used: kept longest
    states.snapshot(state(tokens, 20, nbytes=16))
    assert sorted(n for n, _ in states.snapshots) == [4, 12, 16, 20]
    states.snapshot(state(tokens, 24, nbytes=128))  # larger than the cap: not kept, nothing dropped
    assert sorted(n for n, _ in states.snapshots) == [4, 12, 16, 20]
    states.check_integrity()
