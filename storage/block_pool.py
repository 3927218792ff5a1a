"""The compute-tier block pool: block ids, refcounts, the prefix-cache hash map and LRU eviction.

Every block is in exactly one of three states:
- used:   ref_count > 0 (held by one or more sequences; forked sequences share full blocks),
- cached: ref_count == 0 and it has a hash (its KV is valid and findable by the prefix cache),
- free:   ref_count == 0 and no hash (on the free list).
Cached blocks are reclaimed in least-recently-freed order when the free list runs dry. The pool owns
only bookkeeping; the KV tensors that the ids index live in `KVCache`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from storage.block_hash import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.hash_to_block: dict[BlockHash, int] = {}
        # Free list: a dict used as an ordered set gives O(1) pop from the front and O(1) removal.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # Unreferenced blocks with a hash, least recently released first.
        self._cached: OrderedDict[int, None] = OrderedDict()
        # Called with (block_id, hash) just before a cached block is reclaimed, so a lower tier can
        # keep its contents (the block's KV is still intact at that moment).
        self.on_evict: Callable[[int, BlockHash], None] | None = None  # (`notify_evictions`)
        self.num_evictions = 0
        # Bumped each time a block is allocated: (id, generation) names one incarnation of a block,
        # so a record kept about a block's contents can tell it still describes them.
        self.generations = [0] * num_blocks

    def notify_evictions(self, hook: Callable[[int, BlockHash], None] | None) -> None:
        """Call `hook(block_id, hash)` just before each cached block is reclaimed (None: no one)."""
        self.on_evict = hook

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now: free ones plus reclaimable cached ones."""
        return len(self._free) + len(self._cached)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_available

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.hash_to_block.get(block_hash)

    def match_prefix(self, hashes: Iterable[BlockHash]) -> list[int]:
        """Block ids of the longest run of leading hashes that are cached or in use."""
        matched: list[int] = []
        for h in hashes:
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    # -- mutations ----------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` fresh blocks (ref_count 1), reclaiming cached ones if needed."""
        if not self.can_allocate(num_blocks):
            return None
        blocks: list[int] = []
        for _ in range(num_blocks):
            if self._free:
                block_id, _ = self._free.popitem(last=False)
            else:
                block_id, _ = self._cached.popitem(last=False)
                self._forget_hash(block_id)
                self.num_evictions += 1
            self.ref_counts[block_id] = 1
            self.generations[block_id] += 1
            blocks.append(block_id)
        return blocks

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on blocks that are in use or cached (a prefix hit or a fork)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                if block_id not in self._cached:
                    raise ValueError(f"block {block_id} is free; only used or cached blocks can be shared")
                del self._cached[block_id]
            self.ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each. Blocks reaching zero become cached (if hashed) or free.

        Blocks are released in the order given, so releasing a sequence's table tail-first makes its
        deepest blocks the first to be reclaimed and keeps shared prefixes cached longest.
        """
        for block_id in block_ids:
            count = self.ref_counts[block_id]
            if count <= 0:
                raise ValueError(f"block {block_id} released more often than acquired")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                if self.block_hashes[block_id] is not None:
                    self._cached[block_id] = None
                else:
                    self._free[block_id] = None

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Name a full, written block so later prefixes can find it.

        Returns False (and leaves the block unnamed) when another block already carries this name:
        the first writer keeps it, the duplicate is simply freed when released.
        """
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} must be held to be registered")
        current = self.block_hashes[block_id]
        if current is not None:
            return current == block_hash
        if block_hash in self.hash_to_block:
            return False
        self.block_hashes[block_id] = block_hash
        self.hash_to_block[block_hash] = block_id
        return True

    def evict_cached(self, num_blocks: int) -> int:
        """Reclaim up to `num_blocks` cached blocks to the free list, least recent first."""
        count = 0
        while self._cached and count < num_blocks:
            block_id, _ = self._cached.popitem(last=False)
            self._forget_hash(block_id)
            self._free[block_id] = None
            self.num_evictions += 1
            count += 1
        return count

    def forget_name(self, block_id: int) -> None:
        """Drop a block's name (its contents are lost): no later prefix finds it."""
        self._forget_hash(block_id)
        self._cached.pop(block_id, None)
        if self.ref_counts[block_id] == 0:
            self._free[block_id] = None

    def reset_prefix_cache(self) -> int:
        return self.evict_cached(len(self._cached))

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is None:
            return
        if self.on_evict is not None:
            self.on_evict(block_id, block_hash)
        self.block_hashes[block_id] = None
        del self.hash_to_block[block_hash]

    # -- invariants ---------------------------------------------------------------------------
    def check_integrity(self, holders: Iterable[Iterable[int]] | None = None) -> None:
        """Raise AssertionError unless free + cached + used == total and, when the holders' block
        tables are given, every ref_count equals the number of tables holding that block."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free) and not (free & cached), "a block is both free and cached"
        used = {i for i in range(self.num_blocks) if self.ref_counts[i] > 0}
        assert not (used & (free | cached)), "a referenced block is on the free or cached list"
        assert len(free) + len(cached) + len(used) == self.num_blocks, "a block is in no state"
        assert all(c >= 0 for c in self.ref_counts), "negative ref_count"
        for block_id in free:
            assert self.block_hashes[block_id] is None, f"free block {block_id} still has a hash"
        for block_id in cached:
            assert self.block_hashes[block_id] is not None, f"cached block {block_id} has no hash"
        for block_hash, block_id in self.hash_to_block.items():
            assert self.block_hashes[block_id] == block_hash, "hash map and block names disagree"
        assert sum(h is not None for h in self.block_hashes) == len(self.hash_to_block)
        if holders is not None:
            counts = [0] * self.num_blocks
            for table in holders:
                for block_id in table:
                    counts[block_id] += 1
            assert counts == self.ref_counts, "ref_counts do not match the block tables holding them"
