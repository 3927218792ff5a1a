"""Tier names for logical blocks.

Beams hold logical block ids; the tiers below compute name a block by a `BlockHash`. A name is
minted per incarnation of an id (an id freed and allocated again gets a new name), so a copy left
below compute by a dead block can never be served as the contents of the id's next block.
"""

from __future__ import annotations

import itertools

from storage.block_hash import BlockHash, hash_block


class BlockNames:
    def __init__(self, extra_key: bytes = b"") -> None:
        self.extra_key = extra_key
        self._serials = itertools.count()
        self._names: dict[int, BlockHash] = {}

    def of(self, block_id: int) -> BlockHash:
        name = self._names.get(block_id)
        if name is None:
            name = hash_block(None, [next(self._serials)], self.extra_key)
            self._names[block_id] = name
        return name

    def pop(self, block_id: int) -> BlockHash | None:
        """The id's current name, forgotten (the block died); None if it never had one."""
        return self._names.pop(block_id, None)

    def __len__(self) -> int:
        return len(self._names)
