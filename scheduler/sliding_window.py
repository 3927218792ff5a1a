"""The sliding layers' blocks: a second block pool and, per sequence, a second block table.

A model whose layers attend through a sliding window (Gemma 3's local layers, Mistral's every layer)
keeps those layers' keys and values apart from the full-attention layers' (runtime.kv.window_split).
A query at position p of a sliding layer reads keys at positions (p - window, p] (transformers'
sliding window), and a sequence's later queries sit at or after its next uncomputed token, so once
a block lies wholly before the window of that token no query of the sequence reads it again: its
entry in `Sequence.window_table` becomes `None` and the block goes back to this pool (named, so the
prefix cache may still find it, as long as the pool keeps it).

Invariants, kept here: a window table is as long as its sequence's block table (the same blocks of
tokens); its `None` entries are a leading run (released from the front, never again held); every
block the next query's window reads is held. A prefix hit counts only as far as this pool still
holds, by name, the blocks of the window before the hit's end.
"""

from __future__ import annotations

from scheduler.sequence import Sequence
from storage.block_hash import BlockHash
from storage.block_pool import BlockPool


class SlidingWindow:
    """The sliding layers' pool and what a sequence's window table takes from it."""

    def __init__(self, pool: BlockPool, window: int) -> None:
        if window < 1:
            raise ValueError(f"a sliding window of {window} tokens")
        self.pool = pool
        self.window = window
        self.block_size = pool.block_size

    def first_block(self, position: int) -> int:
        """The first block a query at `position`, or at any later position, reads."""
        return max(0, position - self.window + 1) // self.block_size

    # -- admission ------------------------------------------------------------------------------
    def cached_run(self, hashes: list[BlockHash], num_matched: int) -> int:
        """How many of the `num_matched` leading blocks a prefix hit may count: the most whose window
        before their end this pool still holds by name (the tokens after the hit attend to it)."""
        for run in range(num_matched, 0, -1):
            if all(self.pool.lookup(h) is not None for h in hashes[self.first_block(run * self.block_size):run]):
                return run
        return 0

    def admission(self, hashes: list[BlockHash], num_cached_blocks: int, num_blocks: int) -> tuple[list[int], int] | None:
        """(the named blocks of the window before a hit of `num_cached_blocks` blocks, how many new
        blocks the sequence's `num_blocks` blocks need besides), or None if the pool cannot give them."""
        first = self.first_block(num_cached_blocks * self.block_size)
        named = [self.pool.lookup(h) for h in hashes[first:num_cached_blocks]]
        assert all(b is not None for b in named), "a prefix hit past the window blocks this pool holds"
        num_new = num_blocks - num_cached_blocks
        reclaimable = sum(1 for b in named if self.pool.ref_counts[b] == 0)
        if num_new > self.pool.num_available - reclaimable:
            return None
        return named, num_new  # type: ignore[return-value]

    def admit(self, seq: Sequence, num_cached_blocks: int, taken: tuple[list[int], int]) -> None:
        named, num_new = taken
        self.pool.acquire(named)
        new = self.pool.allocate(num_new)
        assert new is not None
        seq.window_table = [None] * (num_cached_blocks - len(named)) + named + new

    # -- growth ---------------------------------------------------------------------------------
    def num_blocks_to_append(self, seq: Sequence, num_blocks: int) -> int:
        """Blocks `append` would take to reach `num_blocks` blocks: new ones, plus a copy of a shared
        block the next token is written into."""
        return max(0, num_blocks - len(seq.window_table)) + int(self._write_block_is_shared(seq))

    def append(self, seq: Sequence, num_blocks: int) -> list[tuple[int, int]]:
        """Grow the window table to `num_blocks` blocks (the caller checked the pool can); returns the
        copy (src, dst) of a shared block the next token is written into, if any."""
        copies = []
        if self._write_block_is_shared(seq):
            index = seq.num_computed_tokens // self.block_size
            old = seq.window_table[index]
            (new,) = self.pool.allocate(1)  # type: ignore[misc]
            self.pool.release([old])
            seq.window_table[index] = new
            copies.append((old, new))
        missing = num_blocks - len(seq.window_table)
        if missing > 0:
            blocks = self.pool.allocate(missing)
            assert blocks is not None
            seq.window_table.extend(blocks)
        return copies

    def _write_block_is_shared(self, seq: Sequence) -> bool:
        offset = seq.num_computed_tokens % self.block_size
        index = seq.num_computed_tokens // self.block_size
        if offset == 0 or index >= len(seq.window_table):
            return False
        block = seq.window_table[index]
        assert block is not None, "the block a token is written into was released"
        return self.pool.ref_counts[block] > 1 or self.pool.block_hashes[block] is not None

    # -- after the KV is written ----------------------------------------------------------------
    def commit(self, seq: Sequence, first_named: int) -> None:
        """Name the blocks `seq.block_hashes[first_named:]` names (newly full) that this table still
        holds, then release every block wholly before the window of the next token."""
        for index in range(first_named, len(seq.block_hashes)):
            block = seq.window_table[index]
            if block is not None:
                self.pool.register(block, seq.block_hashes[index])
        self.release_behind(seq)

    def release_behind(self, seq: Sequence) -> None:
        first = min(self.first_block(seq.num_computed_tokens), len(seq.window_table))
        index = first
        while index > 0 and seq.window_table[index - 1] is not None:
            index -= 1
        released = seq.window_table[index:first]
        self.pool.release(released)  # oldest first: the first a later allocation reclaims
        seq.window_table[index:first] = [None] * len(released)

    # -- forks and frees ------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence, num_blocks: int) -> bool:
        """Share with `child` (computed up to its `num_computed_tokens`) the parent's blocks of the
        window before its next token, among the first `num_blocks`: a block the parent released (a cut
        further back than its window) where this pool still holds it by its name; False (nothing taken)
        where it does not."""
        first = self.first_block(child.num_computed_tokens)
        shared = []
        for index in range(first, num_blocks):
            block = parent.window_table[index]
            if block is None and index < len(parent.block_hashes):
                block = self.pool.lookup(parent.block_hashes[index])
            if block is None:
                return False
            shared.append(block)
        self.pool.acquire(shared)
        child.window_table = [None] * first + shared
        return True

    def free(self, seq: Sequence) -> None:
        self.pool.release([b for b in reversed(seq.window_table) if b is not None])
        seq.window_table = []

    def check_integrity(self, seqs: list[Sequence]) -> None:
        """The pool's own invariants, its refcounts against the sequences' tables, and each table's."""
        for seq in seqs:
            assert len(seq.window_table) == len(seq.block_table), "a window table out of line with its blocks"
            held = [b is not None for b in seq.window_table]
            assert held == sorted(held), "a window table holds a block after a released one"
            if seq.window_table:
                assert all(held[self.first_block(seq.num_computed_tokens):]), "a block the window reads was released"
        self.pool.check_integrity([[b for b in seq.window_table if b is not None] for seq in seqs])
