"""Host-memory tier: block payloads in one preallocated slab, named by block hash, evicted LRU.

A payload is what one compute-tier block holds, `kv[block_id]` of shape
`[num_layers, 2, num_kv_heads, block_size, head_dim]`, or any other fixed shape the tier is built
for (a head-group piece, for instance). The tier never learns where a payload came from.

Not thread-safe: the tier chain that owns it serialises access.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import torch

from storage.block_hash import BlockHash


class HostTier:
    """Up to `capacity_bytes // block_nbytes` payloads of one shape and dtype, in LRU order."""

    def __init__(self, block_shape: Sequence[int], dtype: torch.dtype, capacity_bytes: int, *,
                 pin_memory: bool = False, name: str = "cpu") -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.name = name
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = dtype
        element_size = torch.empty((), dtype=dtype).element_size()
        self.block_nbytes = math.prod(self.block_shape) * element_size
        if self.block_nbytes <= 0:
            raise ValueError(f"block_shape {self.block_shape} holds no bytes")
        self.num_slots = capacity_bytes // self.block_nbytes
        # Pinned pages make host->device copies asynchronous; they only exist with a CUDA runtime.
        self.is_pinned = bool(pin_memory and torch.cuda.is_available())
        self._slab = torch.empty((self.num_slots, *self.block_shape), dtype=dtype,
                                 pin_memory=self.is_pinned)
        # Invariant: every slot is either in _free_slots or the value of exactly one _slot_of entry.
        self._free_slots: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._slot_of: OrderedDict[BlockHash, int] = OrderedDict()  # oldest first

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._slot_of)

    @property
    def used_bytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.block_nbytes

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slot_of

    def lru_order(self) -> list[BlockHash]:
        """Names held, least recently used first (the next to be evicted first)."""
        return list(self._slot_of)

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The stored payload, marked most recently used; None on a miss.

        The tensor is a view into the slab: it stays valid until this block is evicted or
        discarded, so copy it before the next `put` or `discard`.
        """
        slot = self._slot_of.get(block_hash)
        if slot is None:
            return None
        self._slot_of.move_to_end(block_hash)
        return self._slab[slot]

    # ---- mutations -----------------------------------------------------------------------------
    def put(self, block_hash: BlockHash,
            payload: torch.Tensor) -> list[tuple[BlockHash, torch.Tensor]]:
        """Store a copy of `payload` as most recently used; return the blocks evicted to make room.

        At most one is evicted, the least recently used, returned as an owned copy so the caller
        can hand it to the next tier down. A name already held is only marked used: one name, one
        content. With no slots at all the block itself (the caller's tensor) comes back.
        """
        if tuple(payload.shape) != self.block_shape or payload.dtype != self.dtype:
            raise ValueError(f"payload {tuple(payload.shape)} {payload.dtype} does not match the "
                             f"tier's {self.block_shape} {self.dtype}")
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return []
        if self.num_slots == 0:
            return [(block_hash, payload)]
        evicted: list[tuple[BlockHash, torch.Tensor]] = []
        if not self._free_slots:
            old_hash, old_slot = self._slot_of.popitem(last=False)
            evicted.append((old_hash, self._slab[old_slot].clone()))
            self._free_slots.append(old_slot)
        slot = self._free_slots.pop()
        self._slab[slot].copy_(payload)
        self._slot_of[block_hash] = slot
        return evicted

    def discard(self, block_hash: BlockHash) -> bool:
        """Forget a block; True if it was held."""
        slot = self._slot_of.pop(block_hash, None)
        if slot is None:
            return False
        self._free_slots.append(slot)
        return True

    def check_integrity(self) -> None:
        used = list(self._slot_of.values())
        assert len(used) == len(set(used)), "two blocks share a slot"
        assert not set(used) & set(self._free_slots), "a used slot is also free"
        assert len(used) + len(self._free_slots) == self.num_slots, (
            f"used {len(used)} + free {len(self._free_slots)} != slots {self.num_slots}")
        assert all(0 <= s < self.num_slots for s in used + self._free_slots), "slot out of range"
        assert self.used_bytes <= self.capacity_bytes
