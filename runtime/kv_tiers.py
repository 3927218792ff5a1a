"""The compute-tier prefix cache extended over the host and disk tiers.

A named block the compute pool reclaims is demoted to the host tier (pinned memory on a GPU
machine), and from there to the disk tier, instead of being dropped. Before waiting sequences are
admitted, the blocks of their prompts found in a lower tier are promoted back into the compute pool
as cached blocks, so admission sees them as ordinary prefix hits. A block that fails its checksum
is a miss and is recomputed, never served. On shutdown every named block is written to disk, whose
index lets the next start find them: the prefix cache survives a restart.
"""

from __future__ import annotations

import logging

from scheduler.sequence import Sequence
from storage.block_hash import hash_blocks
from storage.block_pool import BlockPool
from storage.kv_cache import KVCache
from storage.tiers import TierChain

log = logging.getLogger("ponder.runtime")


class TieredPrefixCache:
    def __init__(self, pool: BlockPool, cache: KVCache, chain: TierChain, extra_key: bytes) -> None:
        self.pool = pool
        self.cache = cache
        self.chain = chain
        self.extra_key = extra_key
        self.num_promoted = 0
        pool.on_evict = self._demote

    def _demote(self, block_id: int, block_hash: bytes) -> None:
        self.chain.demote(block_hash, self.cache.read_block(block_id))

    def promote_prefix(self, seq: Sequence, limit: int | None = None) -> int:
        """Bring the blocks of `seq`'s cacheable prefix that live in a lower tier into the compute pool
        as cached blocks, at most `limit` of them. Stops at the first block no tier holds. Returns
        the blocks promoted."""
        block_size = self.pool.block_size
        cacheable = (len(seq.token_ids) - 1) // block_size
        held: list[int] = []  # the prefix so far, held so promoting a later block cannot reclaim it
        promoted = 0
        try:
            for block_hash in hash_blocks(seq.token_ids[:cacheable * block_size], block_size, self.extra_key):
                block_id = self.pool.lookup(block_hash)
                if block_id is None:
                    if (limit is not None and promoted >= limit) or self.chain.lookup(block_hash) is None \
                            or not self.pool.can_allocate(1):
                        break
                    (block_id,) = self.pool.allocate(1)  # type: ignore[misc]
                    if self.chain.fetch(block_hash, out=self.cache.kv[block_id]) is None:
                        self.pool.release([block_id])  # corrupt or gone: recomputed instead
                        break
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
        if self.chain.disk is None:
            return
        src = self.chain.compute_name
        for block_hash, block_id in list(self.pool.hash_to_block.items()):
            self.chain.persist(block_hash, self.cache.read_block(block_id), src)
        self.chain.persist_host()
        lost = self.chain.flush()
        if lost:
            log.warning("%d KV blocks could not be written to the disk tier", len(lost))

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
