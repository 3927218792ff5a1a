"""Block bookkeeping for sequences: prefix-cache admission, slot allocation, forks, copy-on-write.

The manager decides which block ids a sequence's tokens go to; it never touches tensors. Copies it
asks for (copy-on-write of a shared, partially filled block) are returned to the caller to perform
before the step writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.sequence import Sequence
from scheduler.sliding_window import SlidingWindow
from storage.block_hash import hash_block, hash_blocks
from storage.block_pool import BlockPool
from storage.recurrent_state import RecurrentStates


@dataclass
class PrefixStats:
    query_tokens: int = 0
    hit_tokens: int = 0


@dataclass
class SlotAllocation:
    """Blocks to copy (src, dst) before the step runs, for copy-on-write (`window_copies`: in the
    sliding layers' cache)."""

    copies: list[tuple[int, int]] = field(default_factory=list)
    window_copies: list[tuple[int, int]] = field(default_factory=list)


class KVManager:
    def __init__(self, pool: BlockPool, extra_key: bytes = b"", enable_prefix_cache: bool = True,
                 states: RecurrentStates | None = None, window: SlidingWindow | None = None) -> None:
        self.pool = pool
        # A model with linear-attention layers: each sequence's recurrent state lives and forks with its blocks.
        self.states = states
        # A model whose sliding layers' KV is kept apart (scheduler.sliding_window): their blocks, in a
        # pool of their own, are released as they leave the window; `pool` holds the other layers'.
        self.window = window
        self.block_size = pool.block_size
        self.extra_key = extra_key
        self.enable_prefix_cache = enable_prefix_cache
        self.prefix_stats = PrefixStats()

    @property
    def num_free(self) -> int:
        """Free blocks, the fewer of the two pools' where the sliding layers have their own."""
        return self.pool.num_free if self.window is None else min(self.pool.num_free, self.window.pool.num_free)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission ----------------------------------------------------------------------------
    def admit(self, seq: Sequence, max_new_tokens: int, max_cached_tokens: int | None = None) -> bool:
        """Attach the longest cached prefix of `seq` (at most `max_cached_tokens` tokens, so positions
        after it are computed) and blocks for its next `max_new_tokens` uncomputed tokens.
        All or nothing: on False the pool is as it was."""
        assert not seq.block_table, "admitting a sequence that already holds blocks"
        matched: list[int] = []
        hashes = []
        if self.enable_prefix_cache:
            # At least one token must be computed to produce logits, so the last token never hits.
            limit = len(seq.token_ids) - 1 if max_cached_tokens is None else min(len(seq.token_ids) - 1,
                                                                                 max_cached_tokens)
            cacheable = limit // self.block_size
            hashes = hash_blocks(seq.token_ids[:cacheable * self.block_size], self.block_size, self.extra_key)
            matched = self.pool.match_prefix(hashes)
            if self.window is not None:
                matched = matched[:self.window.cached_run(hashes, len(matched))]
        num_cached = len(matched) * self.block_size
        num_new = min(max_new_tokens, len(seq.token_ids) - num_cached)
        num_needed = self.num_blocks_for(num_cached + num_new) - len(matched)
        # Matched blocks that are merely cached count against availability once taken.
        num_reclaimable_matched = sum(1 for b in matched if self.pool.ref_counts[b] == 0)
        if num_needed > self.pool.num_available - num_reclaimable_matched:
            return False
        window = None
        if self.window is not None:
            window = self.window.admission(hashes, len(matched), len(matched) + num_needed)
            if window is None:
                return False
        self.pool.acquire(matched)
        new_blocks = self.pool.allocate(num_needed)
        assert new_blocks is not None
        seq.block_table = matched + new_blocks
        if window is not None:
            self.window.admit(seq, len(matched), window)
        seq.block_hashes = hashes[:len(matched)]
        seq.num_computed_tokens = num_cached
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_cached
            self.prefix_stats.query_tokens += len(seq.token_ids)
            self.prefix_stats.hit_tokens += num_cached
        return True

    # -- growth -------------------------------------------------------------------------------
    def num_blocks_to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `append_slots` would take: new ones, plus one if the write lands in a shared block."""
        end = seq.num_computed_tokens + num_new_tokens
        needed = max(0, self.num_blocks_for(end) - len(seq.block_table))
        if self._write_block_is_shared(seq):
            needed += 1
        return needed

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        if self.window is not None and not self.window.pool.can_allocate(
                self.window.num_blocks_to_append(seq, self.num_blocks_for(seq.num_computed_tokens + num_new_tokens))):
            return False
        return self.pool.can_allocate(self.num_blocks_to_append(seq, num_new_tokens))

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> SlotAllocation | None:
        """Make room to write `num_new_tokens` after the computed ones. None if the pool is short."""
        if not self.can_append(seq, num_new_tokens):
            return None
        result = SlotAllocation()
        if self._write_block_is_shared(seq):
            index = seq.num_computed_tokens // self.block_size
            old = seq.block_table[index]
            (new,) = self.pool.allocate(1)  # type: ignore[misc]
            self.pool.release([old])
            seq.block_table[index] = new
            result.copies.append((old, new))
        end = seq.num_computed_tokens + num_new_tokens
        missing = self.num_blocks_for(end) - len(seq.block_table)
        if missing > 0:
            blocks = self.pool.allocate(missing)
            assert blocks is not None
            seq.block_table.extend(blocks)
        if self.window is not None:
            result.window_copies = self.window.append(seq, len(seq.block_table))
        return result

    def _write_block_is_shared(self, seq: Sequence) -> bool:
        """True when the next token lands in an existing block that another holder shares, or that
        is named (a fork cut inside a block its parent filled): writing it in place would change
        what others read, or what the prefix cache serves under that name."""
        offset = seq.num_computed_tokens % self.block_size
        index = seq.num_computed_tokens // self.block_size
        if offset == 0 or index >= len(seq.block_table):
            return False
        block = seq.block_table[index]
        return self.pool.ref_counts[block] > 1 or self.pool.block_hashes[block] is not None

    # -- after the KV is written ----------------------------------------------------------------
    def commit_computed(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Record that KV up to `num_computed_tokens` is written and name the newly full blocks."""
        seq.num_computed_tokens = num_computed_tokens
        if not seq.block_table:  # no pool block: its KV is elsewhere (head-wise)
            return
        num_named = len(seq.block_hashes)
        if self.enable_prefix_cache:
            num_full = num_computed_tokens // self.block_size
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            for index in range(len(seq.block_hashes), num_full):
                start = index * self.block_size
                parent = hash_block(parent, seq.token_ids[start:start + self.block_size], self.extra_key)
                seq.block_hashes.append(parent)
                self.pool.register(seq.block_table[index], parent)
        if self.window is not None:  # named as the blocks above, then released behind the window
            self.window.commit(seq, num_named)

    # -- forks and frees ------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence, num_tokens: int | None = None) -> None:
        """Let `child` share the blocks of `parent`; the partial last block is copied on first write.

        With `num_tokens`, the child is `parent` cut to its first `num_tokens` tokens (it holds
        those): it shares the blocks of the tokens before the last, whose KV it computes itself, so
        its first step has logits to read even when it holds every token of a computed parent (a
        judge's question asked again word for word)."""
        assert not child.block_table
        computed = parent.num_computed_tokens
        blocks, hashes = parent.block_table, parent.block_hashes
        if num_tokens is not None and num_tokens <= len(parent.token_ids):
            computed = min(computed, num_tokens - 1)
            blocks = blocks[:self.num_blocks_for(computed)]
            hashes = hashes[:computed // self.block_size]
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_computed_tokens = computed
        if self.window is not None and not self.window.fork(parent, child, len(blocks)):
            # The window before the cut was released: the child computes its tokens from the first.
            child.num_computed_tokens = 0
            return
        self.pool.acquire(blocks)
        child.block_table = list(blocks)
        child.block_hashes = list(hashes)
        if self.states is not None:
            self.states.fork(parent.seq_id, child.seq_id)

    def readmit(self, seq: Sequence, max_new_tokens: int, max_cached_tokens: int) -> bool:
        """`admit` again a sequence admitted this step, with at most `max_cached_tokens` tokens from the
        prefix cache: its blocks go back first, and a first admission's prefix statistics are taken
        back (the cached prefix it gives up is to be computed)."""
        if seq.num_preemptions == 0:  # the first admission counted this query and its hit
            self.prefix_stats.query_tokens -= len(seq.token_ids)
            self.prefix_stats.hit_tokens -= seq.num_computed_tokens
        self.free(seq)
        return self.admit(seq, max_new_tokens, max_cached_tokens=max_cached_tokens)

    def fork_prompt(self, parent: Sequence, child: Sequence, num_shared: int) -> None:
        """`fork` for a new prompt beginning with `parent`'s first `num_shared` tokens: what it shares it
        did not have to compute, so it counts as cached."""
        self.fork(parent, child, num_shared)
        child.num_cached_tokens = child.num_computed_tokens

    def window_counts(self, tier: str) -> dict[str, int]:
        """The sliding layers' pool's blocks by state, as tier `<tier>-window` (none without that pool)."""
        if self.window is None:
            return {}
        pool = self.window.pool
        return {f"{tier}-window/used": pool.num_used, f"{tier}-window/cached": pool.num_cached,
                f"{tier}-window/free": pool.num_free}

    def check_integrity(self, holders: list[Sequence]) -> None:
        """The pools' invariants against the block tables of `holders`, every sequence holding blocks."""
        self.pool.check_integrity([s.block_table for s in holders])
        if self.window is not None:
            self.window.check_integrity(holders)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, deepest first, so shared prefixes stay cached longest."""
        self.pool.release(reversed(seq.block_table))
        if self.window is not None:
            self.window.free(seq)
        if self.states is not None:
            self.states.free(seq.seq_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
