"""Chained block hashes: a block's name is a digest of its parent's name, the model key and its tokens.

The same name identifies a block in every tier (compute, host, disk) and across restarts, so the
digest is a stable function of bytes (blake2b), never Python's salted hash().
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes  # 16-byte digest

_DIGEST_SIZE = 16


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes = b"") -> BlockHash:
    """Name of a full block whose tokens follow the block named `parent` (None for the first block).

    `extra_key` separates caches that must never mix (a different model, dtype or adapter).
    """
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    h.update(parent if parent is not None else b"\x00" * _DIGEST_SIZE)
    h.update(len(extra_key).to_bytes(4, "little"))
    h.update(extra_key)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def hash_blocks(token_ids: Sequence[int], block_size: int, extra_key: bytes = b"",
                parent: BlockHash | None = None) -> list[BlockHash]:
    """Names of every full block of `token_ids`, chained from `parent`."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], extra_key)
        hashes.append(parent)
    return hashes
