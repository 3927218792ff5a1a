"""Which compute-tier slot holds which block copy: the residency map of the offloaded executor.

A key names one compute copy of a logical block: the logical block id itself when beams share
copies (lbs), or (beam id, logical block id) when every beam keeps its own copy (lbs_no_prefix).
Slots are rows of the compute `KVCache`.

Invariants (checked by `check_integrity`):
- every slot is free or holds exactly one key, and at most `limit` keys are held;
- a held key is pinned (read by the running group, or a transfer into it is in flight) or on the
  LRU list of evictable copies, never both;
- dirty keys are held; a dirty copy holds KV written since it was loaded, so evicting it needs
  a write-back, while a clean copy may simply be dropped.
Pure bookkeeping: no tensors, no transfers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

Key = Hashable


class Residency:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("the compute tier needs at least one slot")
        self.num_slots = num_slots
        self.limit = num_slots  # slots usable now (a device may have less free memory than slots)
        self._slot_of: dict[Key, int] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._lru: OrderedDict[Key, None] = OrderedDict()  # unpinned held keys, least recent first
        self._pins: dict[Key, int] = {}
        self.dirty: set[Key] = set()
        self.max_held = 0

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_held(self) -> int:
        return len(self._slot_of)

    def slot_of(self, key: Key) -> int | None:
        return self._slot_of.get(key)

    def is_held(self, key: Key) -> bool:
        return key in self._slot_of

    def is_pinned(self, key: Key) -> bool:
        return key in self._pins

    def held_keys(self) -> list[Key]:
        return list(self._slot_of)

    def num_obtainable(self, protect: set[Key]) -> int:
        """Slots `assign` could hand out now, evicting only unpinned keys outside `protect`."""
        room = max(0, self.limit - len(self._slot_of))
        return room + sum(1 for k in self._lru if k not in protect)

    def victims(self, num: int, protect: set[Key]) -> list[Key]:
        """Up to `num` unpinned keys outside `protect`, least recently used first."""
        out: list[Key] = []
        for key in self._lru:
            if len(out) == num:
                break
            if key not in protect:
                out.append(key)
        return out

    def num_to_evict(self) -> int:
        """Keys that must go before one more can be assigned."""
        return max(0, len(self._slot_of) + 1 - self.limit)

    # ---- mutations -----------------------------------------------------------------------------
    def assign(self, key: Key) -> int | None:
        """Give `key` a free slot, pinned; None when `limit` keys are already held."""
        if key in self._slot_of:
            raise ValueError(f"{key!r} already holds slot {self._slot_of[key]}")
        if len(self._slot_of) >= self.limit or not self._free:
            return None
        slot = self._free.pop()
        self._slot_of[key] = slot
        self._pins[key] = 1
        self.max_held = max(self.max_held, len(self._slot_of))
        return slot

    def pin(self, keys: Iterable[Key]) -> None:
        for key in keys:
            if key not in self._slot_of:
                raise KeyError(f"{key!r} is not resident")
            self._lru.pop(key, None)
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, keys: Iterable[Key]) -> None:
        """Drop one pin each; a key left unpinned becomes the most recently used."""
        for key in keys:
            count = self._pins[key]
            if count == 1:
                del self._pins[key]
                self._lru[key] = None
            else:
                self._pins[key] = count - 1

    def release(self, key: Key) -> int:
        """Forget `key` (pinned or not) and free its slot."""
        slot = self._slot_of.pop(key)
        self._pins.pop(key, None)
        self._lru.pop(key, None)
        self.dirty.discard(key)
        self._free.append(slot)
        return slot

    def check_integrity(self) -> None:
        held = set(self._slot_of)
        slots = list(self._slot_of.values())
        assert len(slots) == len(set(slots)), "two keys share a slot"
        assert not set(slots) & set(self._free), "a held slot is also free"
        assert len(slots) + len(self._free) == self.num_slots, "a slot is neither held nor free"
        assert set(self._pins) | set(self._lru) == held, "a held key is neither pinned nor evictable"
        assert not set(self._pins) & set(self._lru), "a pinned key is on the LRU list"
        assert all(c > 0 for c in self._pins.values()), "a non-positive pin count"
        assert self.dirty <= held, "a dirty key is not held"
