"""Recurrent state beside the paged KV: what a linear-attention layer (Gated DeltaNet) carries from one
token to the next instead of keys and values.

A sequence's state is a `State`: the tensors of every recurrent layer after its first `num_tokens`
tokens, with the key of exactly those tokens (`prefix_key`). A `State` is never written after it is
made (a step makes new tensors), so forks share it as they share full KV blocks: `fork` points the
child at its parent's state, `free` forgets a sequence's. Snapshots at block boundaries (every
`block_size` tokens a step passes) are kept by their prefix key in a byte-capped LRU: a sequence whose
own state does not end where its next step starts (a prefix-cache hit, a fork cut before its parent's
end, a recomputation after preemption) resumes from the latest snapshot at or before that point, or
from the empty state at token 0, and the runner recomputes the tokens in between. A state is never
guessed: one that does not cover exactly the tokens a step starts after is not used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch


def prefix_keys(token_ids: Seq[int], block_size: int, end: int) -> tuple[list[int], int]:
    """(the key of each full block boundary's prefix up to `end`, the key of `token_ids[:end]`).

    Keys chain block by block (a boundary's key hashes the previous one with its block's tokens), so a
    sequence's keys are computed in one pass and two sequences share a key exactly where they share
    the tokens before it (with 64-bit hashes)."""
    keys, key = [], hash(())
    full = end // block_size
    for index in range(full):
        key = hash((key, tuple(token_ids[index * block_size:(index + 1) * block_size])))
        keys.append(key)
    if end % block_size:
        return keys, hash((key, tuple(token_ids[full * block_size:end])))
    return keys, key


@dataclass(frozen=True)
class State:
    """Every recurrent layer's tensors after the `num_tokens` tokens named by `prefix_key`."""

    num_tokens: int
    prefix_key: int
    tensors: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass(frozen=True)
class Resume:
    """Where a sequence's next step starts computing its recurrent layers: after `state` (None: from
    token 0 with empty states), which may be before the step's first new token."""

    state: State | None

    @property
    def num_tokens(self) -> int:
        return 0 if self.state is None else self.state.num_tokens


class RecurrentStates:
    """Sequences' states by id, and block-boundary snapshots by prefix key (at most `snapshot_bytes`)."""

    def __init__(self, block_size: int, snapshot_bytes: int) -> None:
        self.block_size = block_size
        self.snapshot_bytes = snapshot_bytes
        self.states: dict[int, State] = {}
        self.snapshots: OrderedDict[tuple[int, int], State] = OrderedDict()
        self.num_snapshot_bytes = 0
        self.num_resumed_tokens = 0  # tokens recomputed because no state ended where a step started

    # -- the sequence's own -------------------------------------------------------------------
    def resume(self, seq_id: int, token_ids: Seq[int], start: int) -> Resume:
        """The state a sequence computing from `start` continues: its own when it covers exactly
        `token_ids[:start]`, else the latest snapshot at or before `start`, else none (token 0)."""
        boundaries, key = prefix_keys(token_ids, self.block_size, start)
        own = self.states.get(seq_id)
        if own is not None and own.num_tokens == start and own.prefix_key == key:
            return Resume(own)
        exact = self.snapshots.get((start, key))
        if exact is not None:
            self.snapshots.move_to_end((start, key))
            return Resume(exact)
        for index in range(len(boundaries) - 1, -1, -1):
            found = self.snapshots.get(((index + 1) * self.block_size, boundaries[index]))
            if found is not None:
                self.snapshots.move_to_end((found.num_tokens, found.prefix_key))
                self.num_resumed_tokens += start - found.num_tokens
                return Resume(found)
        self.num_resumed_tokens += start
        return Resume(None)

    def store(self, seq_id: int, state: State) -> None:
        self.states[seq_id] = state

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child starts from its parent's state (shared: states are never written in place); a
        child cut before its parent's end finds it does not fit and resumes from a snapshot."""
        state = self.states.get(parent_id)
        if state is not None:
            self.states[child_id] = state

    def free(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)

    # -- snapshots -----------------------------------------------------------------------------
    def snapshot(self, state: State) -> None:
        """Keep `state` (taken at a block boundary) for sequences that resume there later; the least
        recently used go first when the snapshots would pass their byte cap."""
        assert state.num_tokens % self.block_size == 0, "snapshots are taken at block boundaries"
        key = (state.num_tokens, state.prefix_key)
        if key in self.snapshots:
            self.snapshots.move_to_end(key)
            return
        if state.nbytes > self.snapshot_bytes:
            return
        self.snapshots[key] = state
        self.num_snapshot_bytes += state.nbytes
        while self.num_snapshot_bytes > self.snapshot_bytes:
            _, dropped = self.snapshots.popitem(last=False)
            self.num_snapshot_bytes -= dropped.nbytes

    def check_integrity(self) -> None:
        assert self.num_snapshot_bytes == sum(s.nbytes for s in self.snapshots.values())
        assert self.num_snapshot_bytes <= self.snapshot_bytes
        for (num_tokens, key), state in self.snapshots.items():
            assert (state.num_tokens, state.prefix_key) == (num_tokens, key)
            assert num_tokens % self.block_size == 0
