"""The compute-tier prefix cache extended over the host and disk tiers.

A named block the compute pool reclaims is demoted to the host tier (pinned memory on a GPU
machine), and from there to the disk tier, instead of being dropped. Before waiting sequences are
admitted, the blocks of their prompts found in a lower tier are promoted back into the compute pool
as cached blocks, so admission sees them as ordinary prefix hits. A block that fails its checksum
is a miss and is recomputed, never served. On shutdown every named block is written to disk, whose
index lets the next start find them: the prefix cache survives a restart.

Nothing here blocks the compute stream. A demoted block is copied out on the transfer engine's side
stream (the compute stream waits for that copy before the slot is written again) and handed to the
chain on its worker thread, so host copies and disk writes leave the engine loop. A promoted block
is staged in private pinned memory and copied in asynchronously on the compute stream, ahead of the
step that reads it. Before any lookup, demotions still in flight are awaited, so whether a block is
found never depends on timing.

It is a residency (runtime.kv.residency): the one whose blocks are named across incarnations, and
one a step's layers need nothing of.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from scheduler.sequence import Sequence
from storage.block_hash import hash_blocks
from storage.block_pool import BlockPool
from storage.kv_cache import KVCache
from storage.piece_transfers import PieceLost
from storage.tiers import TierChain, TransferEngine

log = logging.getLogger("ponder.runtime")


class TieredPrefixCache:
    def __init__(self, pool: BlockPool, cache: KVCache, chain: TierChain, extra_key: bytes) -> None:
        self.pool = pool
        self.cache = cache
        self.chain = chain
        self.extra_key = extra_key
        self.num_promoted = 0
        self.seconds_stalled = 0.0  # the engine loop blocked on demotions and promotions
        self.transfers = TransferEngine(chain, device=cache.device)
        self._in_flight: list[Future] = []  # demotions handed to the transfer engine, not yet awaited
        pool.notify_evictions(self._demote)

    def check_integrity(self) -> None:
        """The tiers below compute agree with themselves (storage.tiers)."""
        self.chain.check_integrity()

    # ---- a step: whole blocks move before admission, never around a layer ---------------------
    def attention(self, scheduled) -> None:
        return None

    def begin_step(self, scheduled, copies) -> bool:
        return False

    def before_layer(self, layer: int) -> None:
        pass

    def after_layer(self, layer: int) -> None:
        pass

    def end_step(self) -> None:
        pass

    def recover(self, lost: PieceLost, scheduler) -> None:
        raise lost  # a step never reads below compute: its blocks came back before admission

    def bytes_moved(self) -> dict[str, int]:
        return self.chain.bytes_moved  # a copy

    def stall_seconds(self) -> float:
        return self.seconds_stalled

    def _demote(self, block_id: int, block_hash: bytes) -> None:
        if len(self._in_flight) >= 256:  # with no lookups for a while: forget the finished ones
            self._reap(wait=False)
        self._in_flight.append(self.transfers.offload(block_hash, self.cache.read_block(block_id)))

    def drain(self) -> None:
        """Wait until every demotion handed out so far is in the chain."""
        began = time.perf_counter()
        self._reap(wait=True)
        self.seconds_stalled += time.perf_counter() - began

    def _reap(self, wait: bool) -> None:
        pending = []
        for future in self._in_flight:
            if not wait and not future.done():
                pending.append(future)
                continue
            error = future.exception()
            if error is not None:  # the block is lost to the lower tiers; it is recomputed when needed
                log.warning("a KV block could not be demoted: %s", error)
        self._in_flight = pending

    def promote_prefix(self, seq: Sequence, limit: int | None = None) -> int:
        """Bring the blocks of `seq`'s cacheable prefix that live in a lower tier into the compute pool
        as cached blocks, at most `limit` of them. Stops at the first block no tier holds. Returns
        the blocks promoted."""
        self.drain()
        block_size = self.pool.block_size
        cacheable = (len(seq.token_ids) - 1) // block_size
        held: list[int] = []  # the prefix so far, held so promoting a later block cannot reclaim it
        promoted = 0
        try:
            for block_hash in hash_blocks(seq.token_ids[:cacheable * block_size], block_size, self.extra_key):
                block_id = self.pool.lookup(block_hash)
                if block_id is None:
                    self.drain()  # an allocation above may have just demoted this very block
                    if (limit is not None and promoted >= limit) or self.chain.lookup(block_hash) is None \
                            or not self.pool.can_allocate(1):
                        break
                    (block_id,) = self.pool.allocate(1)  # type: ignore[misc]
                    began = time.perf_counter()
                    staged = self.chain.fetch(block_hash, out=self.cache.staging_block())
                    self.seconds_stalled += time.perf_counter() - began
                    if staged is None:
                        self.pool.release([block_id])  # corrupt or gone: recomputed instead
                        break
                    self.cache.write_block(block_id, staged, is_private=True)
                    self.pool.register(block_id, block_hash)
                    self.num_promoted += 1
                    promoted += 1
                else:
                    self.pool.acquire([block_id])
                held.append(block_id)
        finally:
            self.pool.release(reversed(held))  # cached again: admission takes them as prefix hits
        return promoted

    def persist(self) -> None:
        """Write every named block (compute pool and host tier) to disk and flush the disk index."""
        self.drain()
        if self.chain.disk is None:
            return
        src = self.chain.compute_name
        for block_hash, block_id in list(self.pool.hash_to_block.items()):
            self.chain.persist(block_hash, self.cache.read_block(block_id), src)
        self.chain.persist_host()
        lost = self.chain.flush()
        if lost:
            log.warning("%d KV blocks could not be written to the disk tier", len(lost))

    def close(self) -> None:
        """Persist what outlives the process, then stop the transfer engine."""
        try:
            self.persist()
        finally:
            self.transfers.close()

    def block_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        host = self.chain.host
        if host is not None:
            counts[f"{host.name}/cached"] = host.num_blocks
            counts[f"{host.name}/free"] = host.num_slots - host.num_blocks
        disk = self.chain.disk
        if disk is not None:
            counts[f"{disk.name}/cached"] = disk.num_blocks
        return counts
