"""The grouped policies' compute tier: a `KVCache` of budget slots over the host/disk chain.

Blocks move whole (`kv[slot]`, every layer) between the compute tier and the chain, through the
`TransferEngine`: loads with `prefetch` (a demand load is a prefetch waited on at once), write-backs
with `offload`. One worker runs both in submission order, so a block written back before it is
loaded again is found.

A copy is dirty from the moment a group may write into it until it is written back; a clean copy
is dropped without a write, unless the chain has lost its block. A dirty block's stale copy below
compute is discarded before the write-back, because the chain keeps the first contents a name
was given.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future

from runtime.offload.names import BlockNames
from runtime.offload.residency import Key, Residency
from storage.block_hash import BlockHash
from storage.kv_cache import KVCache
from storage.tiers import PrefetchHandle, TierChain, TransferEngine


class BlockLost(RuntimeError):
    """A block needed in the compute tier is in no tier (a disk write failed, say)."""


def logical_id(key: Key) -> int:
    return key[1] if isinstance(key, tuple) else key


class BlockStore:
    def __init__(self, cache: KVCache, chain: TierChain, engine: TransferEngine,
                 names: BlockNames) -> None:
        self.cache = cache
        self.chain = chain
        self.engine = engine
        self.names = names
        self.residency = Residency(cache.num_blocks)
        self.block_bytes = cache.bytes_per_block
        self._inflight: dict[Key, tuple[PrefetchHandle, BlockHash]] = {}
        self._writes: dict[BlockHash, Future] = {}
        self._keys_of: dict[int, set[Key]] = {}
        self.bytes_prefetched = 0  # loads issued ahead of the group that reads them
        self.num_loads = 0
        self.num_writebacks = 0
        self.writeback_seconds = 0.0  # caller time spent handing write-backs to the engine

    # ---- queries -------------------------------------------------------------------------------
    def slot(self, key: Key) -> int:
        slot = self.residency.slot_of(key)
        if slot is None or key in self._inflight:
            raise KeyError(f"{key!r} is not resident")
        return slot

    def is_present(self, key: Key) -> bool:
        """Resident, or on its way in."""
        return self.residency.is_held(key)

    @property
    def stall_seconds(self) -> float:
        return self.engine.stall_seconds + self.writeback_seconds

    # ---- loading -------------------------------------------------------------------------------
    def prefetch(self, keys: Sequence[Key], protect: set[Key]) -> list[Key]:
        """Start loading the absent `keys`, in order, into as many slots as can be had without
        evicting pinned keys or `protect`; return the keys issued. They stay pinned until a group
        `acquire`s them."""
        wanted = [k for k in dict.fromkeys(keys) if not self.residency.is_held(k)]
        room = self.residency.num_obtainable(protect | set(wanted))
        issued = wanted[:room]
        self._issue(issued, protect | set(issued))
        self.bytes_prefetched += len(issued) * self.block_bytes
        return issued

    def acquire(self, keys: Sequence[Key], protect: set[Key]) -> None:
        """Make `keys` resident and pin each once for the caller: wait for those in flight (time
        blocked counts as stall) and load the rest now."""
        keys = list(dict.fromkeys(keys))
        absent = [k for k in keys if not self.residency.is_held(k)]
        if len(absent) > self.residency.num_obtainable(protect | set(keys)):
            raise MemoryError(f"{len(keys)} blocks do not fit in {self.residency.limit} slots")
        self._issue(absent, protect | set(keys))
        for key in keys:
            entry = self._inflight.pop(key, None)
            if entry is None:
                self.residency.pin([key])  # already resident: the caller's pin
                continue
            handle, name = entry  # the pin taken when it was issued becomes the caller's
            if handle.wait(name) is None:
                raise BlockLost(f"block {logical_id(key)} is in no tier")

    def create(self, key: Key, protect: set[Key]) -> int:
        """A slot for a block the caller is about to write from scratch: pinned and dirty."""
        self._make_room(1, protect | {key})
        slot = self.residency.assign(key)
        if slot is None:
            raise MemoryError(f"no slot for block {logical_id(key)} within {self.residency.limit}")
        self._keys_of.setdefault(logical_id(key), set()).add(key)
        self.residency.dirty.add(key)
        return slot

    def copy(self, src: Key, dst: Key) -> None:
        """Copy-on-write of a shared, partially filled block: `dst` becomes a dirty copy of `src`.
        Both end unpinned."""
        self.acquire([src], {src, dst})
        try:
            self.create(dst, {src, dst})
            self.cache.copy_blocks([(self.slot(src), self.slot(dst))])
            self.residency.unpin([dst])
        finally:
            self.residency.unpin([src])

    def mark_written(self, keys: Iterable[Key]) -> None:
        self.residency.dirty.update(keys)

    def release(self, keys: Iterable[Key], *, drop: bool = False) -> None:
        """Drop the caller's pin on each key; with `drop`, also evict them (writing back dirty
        ones), so nothing of the caller's stays resident."""
        keys = list(keys)
        self.residency.unpin(keys)
        if drop:
            self.drop(keys)

    def drop(self, keys: Iterable[Key]) -> None:
        """Evict resident, unpinned `keys` now (writing back dirty ones)."""
        for key in keys:
            if self.residency.is_held(key) and not self.residency.is_pinned(key):
                self._evict(key)

    def set_limit(self, num_slots: int) -> None:
        """Use at most `num_slots` slots from now on, evicting unpinned copies to get there."""
        self.residency.limit = max(1, min(num_slots, self.residency.num_slots))
        excess = self.residency.num_held - self.residency.limit
        for key in self.residency.victims(max(0, excess), set()):
            self._evict(key)

    def forget(self, block_ids: Iterable[int]) -> None:
        """Dead logical blocks: free their copies without write-back and discard them below."""
        for block_id in block_ids:
            for key in self._keys_of.pop(block_id, ()):
                assert key not in self._inflight, f"dead block {block_id} is being loaded"
                self.residency.release(key)
            name = self.names.pop(block_id)
            if name is not None:
                self._settle(name)
                self.chain.discard(name)

    def close(self) -> None:
        for future in self._writes.values():
            future.result()
        self._writes.clear()
        self.engine.close()

    def check_integrity(self) -> None:
        self.residency.check_integrity()
        held = set(self.residency.held_keys())
        tracked = {k for keys in self._keys_of.values() for k in keys}
        assert tracked == held, "a resident key is not tracked under its block, or the reverse"
        assert set(self._inflight) <= held, "a load in flight has no slot"
        self.chain.check_integrity()

    # ---- internals -----------------------------------------------------------------------------
    def _issue(self, keys: Sequence[Key], protect: set[Key]) -> None:
        # The engine dedups names within one prefetch, so copies of one block for several beams
        # go out in separate batches.
        batches: list[dict[BlockHash, object]] = []
        batch_keys: list[list[Key]] = []
        for key in keys:
            self._make_room(1, protect)
            slot = self.residency.assign(key)
            if slot is None:
                raise MemoryError(f"no slot for block {logical_id(key)}")
            self._keys_of.setdefault(logical_id(key), set()).add(key)
            name = self.names.of(logical_id(key))
            for batch, members in zip(batches, batch_keys):
                if name not in batch:
                    break
            else:
                batch, members = {}, []
                batches.append(batch)
                batch_keys.append(members)
            batch[name] = self.cache.kv[slot]
            members.append(key)
        for batch, members in zip(batches, batch_keys):
            handle = self.engine.prefetch(list(batch), out=batch)
            for key in members:
                self._inflight[key] = (handle, self.names.of(logical_id(key)))
        self.num_loads += len(keys)

    def _make_room(self, num: int, protect: set[Key]) -> None:
        need = self.residency.num_held + num - self.residency.limit
        if need <= 0:
            return
        victims = self.residency.victims(need, protect)
        if len(victims) < need:
            raise MemoryError(f"compute tier full: {self.residency.num_held} blocks pinned or "
                              f"protected, limit {self.residency.limit}")
        for key in victims:
            self._evict(key)

    def _evict(self, key: Key) -> None:
        block_id = logical_id(key)
        name = self.names.of(block_id)
        slot = self.residency.slot_of(key)
        is_dirty = key in self.residency.dirty
        if not is_dirty:
            self._settle(name)
        if is_dirty or self.chain.lookup(name) is None:
            start = time.perf_counter()
            self._settle(name)
            self.chain.discard(name)  # a stale copy would shadow the new contents
            self._writes[name] = self.engine.offload(name, self.cache.kv[slot])
            self.writeback_seconds += time.perf_counter() - start
            self.num_writebacks += 1
        self.residency.release(key)
        keys = self._keys_of.get(block_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._keys_of[block_id]

    def _settle(self, name: BlockHash) -> None:
        """Wait for a write-back of `name` still queued, and drop finished ones."""
        future = self._writes.pop(name, None)
        if future is not None:
            future.result()
        if len(self._writes) > 256:
            self._writes = {n: f for n, f in self._writes.items() if not f.done()}
