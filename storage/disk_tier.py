"""Disk tier: block payloads in group files under a private directory, after KVSwap.

Layout, under `directory/ns-<digest of namespace>/` (directories 0700, files 0600):
  `<group id>.kvg`  several blocks back to back, written once with one sequential write, so a read
                    of any of them is one large sequential read of the group (KVSwap's grouping);
  `index.json`      the namespace and, per group in LRU order, each block's name, offset, size,
                    crc32, dtype and shape. Written atomically (temporary file, fsync, rename).

The namespace (model, dtype, layout) picks the subdirectory and is checked against the index, so
another model never reads these blocks. A block's crc32 is seeded with its name and checked on
every read: a corrupt, short or missing read is a miss and the entry is dropped, never served.

The index is a snapshot, rewritten every `index_interval_groups` group writes and on `flush()`.
After a crash the blocks written since the last snapshot are lost (only misses); their files
are orphans and are deleted when the directory is opened again.

The byte budget counts what is on disk (whole group files, including the dead bytes of dropped
blocks) plus the group being filled. Eviction drops whole groups, least recently used first.
Any OSError on a write (ENOSPC above all) disables spilling with a warning; reads go on.

With `uncached_reads`, group files are read past the page cache (`storage.uncached_io`: O_DIRECT
where the file system allows it, else dropping the file's pages); `read_path` says which.

Not thread-safe: the tier chain that owns it serialises access.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from hashlib import blake2b
from pathlib import Path

import torch

from storage.block_hash import BlockHash
from storage.uncached_io import best_read_path, drop_written, read_file

logger = logging.getLogger(__name__)

_INDEX_FORMAT = 1
_INDEX_NAME = "index.json"
_GROUP_SUFFIX = ".kvg"


@dataclass(frozen=True)
class _Entry:
    group_id: int
    offset: int
    nbytes: int
    crc: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class _Group:
    file_nbytes: int
    block_hashes: set[BlockHash] = field(default_factory=set)


def _checksum(block_hash: BlockHash, data) -> int:
    # Seeded with the name, so a payload filed under the wrong name fails too.
    return zlib.crc32(data, zlib.crc32(block_hash))


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class DiskTier:
    """Blocks of any shape and dtype, written `blocks_per_group` at a time, within a byte budget."""

    def __init__(self, directory: str | os.PathLike, namespace: str, capacity_bytes: int, *,
                 blocks_per_group: int = 8, reuse_buffer_groups: int = 4,
                 index_interval_groups: int = 16, name: str = "disk",
                 uncached_reads: bool = False) -> None:
        if blocks_per_group < 1 or reuse_buffer_groups < 0 or index_interval_groups < 1:
            raise ValueError("blocks_per_group and index_interval_groups must be >= 1, "
                             "reuse_buffer_groups >= 0")
        self.name = name
        self.namespace = namespace
        self.capacity_bytes = capacity_bytes
        self.blocks_per_group = blocks_per_group
        self.reuse_buffer_groups = reuse_buffer_groups
        self.index_interval_groups = index_interval_groups
        self.is_enabled = True
        self.num_group_reads = 0  # group files read from disk (reuse-buffer hits excluded)
        self.read_path = best_read_path(uncached_reads)  # storage.uncached_io: how groups are read
        digest = blake2b(namespace.encode(), digest_size=8).hexdigest()
        self.path = Path(directory) / f"ns-{digest}"
        self._entries: dict[BlockHash, _Entry] = {}
        self._groups: OrderedDict[int, _Group] = OrderedDict()  # written groups, oldest first
        # The group being filled: its bytes, and the names in it (their entries carry its id).
        self._pending = bytearray()
        self._pending_hashes: list[BlockHash] = []
        self._reuse: OrderedDict[int, bytearray] = OrderedDict()  # FIFO of recently read groups
        self._next_group_id = 0
        self._groups_since_index = 0
        self._used_bytes = 0
        try:
            for d in (Path(directory), self.path):
                if not d.exists():
                    d.mkdir(mode=0o700, parents=True)
                    os.chmod(d, 0o700)  # mkdir's mode is filtered by the umask
            self._load_index()
        except OSError as exc:
            self._disable(f"cannot use {self.path}: {exc}")

    # ---- queries -------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._entries)

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def group_order(self) -> list[list[BlockHash]]:
        """Written groups, least recently used first, each as its sorted block names."""
        return [sorted(g.block_hashes) for g in self._groups.values()]

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The payload as an owned tensor of its stored dtype and shape; None on a miss."""
        entry = self._entries.get(block_hash)
        if entry is None:
            return None
        if entry.group_id == self._next_group_id:
            data = self._pending
        else:
            self._groups.move_to_end(entry.group_id)
            data = self._read_group(entry.group_id)
            if data is None:
                return None
        end = entry.offset + entry.nbytes
        if len(data) < end:
            self._drop_bad(block_hash, f"short read ({len(data)} < {end} bytes)")
            return None
        view = memoryview(data)[entry.offset:end]
        if _checksum(block_hash, view) != entry.crc:
            self._drop_bad(block_hash, "checksum mismatch")
            return None
        flat = torch.frombuffer(data, dtype=torch.uint8, count=entry.nbytes, offset=entry.offset)
        return flat.clone().view(entry.dtype).reshape(entry.shape)

    # ---- mutations -----------------------------------------------------------------------------
    def put(self, block_hash: BlockHash, payload: torch.Tensor) -> list[BlockHash]:
        """Store a copy of the payload; return the names this call dropped from the tier.

        Those are the groups evicted to make room and, if a group write fails, the blocks lost
        with it. Nothing is stored when spilling is disabled or the payload exceeds the whole
        budget: ask `contains` afterwards. A name already held is only marked used.
        """
        if not self.is_enabled:
            return []
        if block_hash in self._entries:
            group_id = self._entries[block_hash].group_id
            if group_id in self._groups:
                self._groups.move_to_end(group_id)
            return []
        data = payload.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        nbytes = data.nbytes
        if nbytes == 0 or nbytes > self.capacity_bytes:
            return []
        evicted: list[BlockHash] = []
        while self._used_bytes + nbytes > self.capacity_bytes and self._groups:
            evicted.extend(self._evict_group(next(iter(self._groups))))
        if self._used_bytes + nbytes > self.capacity_bytes:
            return evicted  # the group being filled alone leaves no room
        self._entries[block_hash] = _Entry(self._next_group_id, len(self._pending), nbytes,
                                           _checksum(block_hash, data), payload.dtype,
                                           tuple(payload.shape))
        self._pending += memoryview(data)
        self._pending_hashes.append(block_hash)
        self._used_bytes += nbytes
        if len(self._pending_hashes) >= self.blocks_per_group:
            evicted.extend(self._write_pending_group())
        return evicted

    def discard(self, block_hash: BlockHash) -> bool:
        """Forget a block; its bytes stay counted until its whole group is gone."""
        entry = self._entries.pop(block_hash, None)
        if entry is None:
            return False
        if entry.group_id == self._next_group_id:
            self._pending_hashes.remove(block_hash)
        else:
            group = self._groups[entry.group_id]
            group.block_hashes.discard(block_hash)
            if not group.block_hashes:
                self._evict_group(entry.group_id)
        return True

    def flush(self) -> list[BlockHash]:
        """Write the group being filled and the index, so a new DiskTier sees every block.

        Returns the names lost if a write failed. A disabled tier writes nothing more."""
        if not self.is_enabled:
            return []
        lost = self._write_pending_group()
        if self.is_enabled:
            self._write_index()
        return lost

    close = flush

    def check_integrity(self) -> None:
        on_disk = sum(g.file_nbytes for g in self._groups.values())
        assert self._used_bytes == on_disk + len(self._pending), (
            f"used {self._used_bytes} != files {on_disk} + pending {len(self._pending)}")
        assert self._used_bytes <= self.capacity_bytes, "over budget"
        grouped = {h for g in self._groups.values() for h in g.block_hashes}
        assert not grouped & set(self._pending_hashes), "a block is both pending and written"
        assert grouped | set(self._pending_hashes) == set(self._entries), \
            "entries and groups disagree"
        for h, e in self._entries.items():
            limit = len(self._pending) if e.group_id == self._next_group_id else \
                self._groups[e.group_id].file_nbytes
            assert e.offset + e.nbytes <= limit, f"block {h.hex()} lies past the end of its group"
        assert all(g.block_hashes for g in self._groups.values()), "an empty group was kept"
        assert set(self._reuse) <= set(self._groups), "the reuse buffer holds a dropped group"

    # ---- internals -----------------------------------------------------------------------------
    def _group_path(self, group_id: int) -> Path:
        return self.path / f"{group_id:010d}{_GROUP_SUFFIX}"

    def _read_group(self, group_id: int) -> bytearray | None:
        data = self._reuse.get(group_id)
        if data is not None:
            return data
        expected = self._groups[group_id].file_nbytes
        try:
            data, self.read_path = read_file(self._group_path(group_id), expected, self.read_path)
        except OSError as exc:
            logger.warning("disk tier: group %d unreadable (%s); its blocks are dropped",
                           group_id, exc)
            self._evict_group(group_id)
            return None
        self.num_group_reads += 1
        if self.reuse_buffer_groups:
            self._reuse[group_id] = data
            if len(self._reuse) > self.reuse_buffer_groups:
                self._reuse.popitem(last=False)
        return data

    def _drop_bad(self, block_hash: BlockHash, why: str) -> None:
        logger.warning("disk tier: block %s dropped: %s", block_hash.hex(), why)
        self.discard(block_hash)

    def _evict_group(self, group_id: int) -> list[BlockHash]:
        group = self._groups.pop(group_id)
        self._reuse.pop(group_id, None)
        for h in group.block_hashes:
            del self._entries[h]
        self._used_bytes -= group.file_nbytes
        try:
            os.unlink(self._group_path(group_id))
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("disk tier: cannot delete group %d: %s", group_id, exc)
        return sorted(group.block_hashes)

    def _write_pending_group(self) -> list[BlockHash]:
        """Write the group being filled as one file; return the names lost if the write failed."""
        data, live = self._pending, self._pending_hashes
        self._pending, self._pending_hashes = bytearray(), []
        if not live:  # every block in it was discarded
            self._used_bytes -= len(data)
            return []
        group_id, path = self._next_group_id, self._group_path(self._next_group_id)
        self._next_group_id += 1  # the written entries keep the id; new pending ones get the next
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.fchmod(fd, 0o600)
                _write_all(fd, data)
                drop_written(fd, self.read_path)
            finally:
                os.close(fd)
        except OSError as exc:
            for h in live:
                del self._entries[h]
            self._used_bytes -= len(data)
            try:
                os.unlink(path)
            except OSError:
                pass
            self._disable(f"writing {path} failed: {exc}")
            return list(live)
        self._groups[group_id] = _Group(len(data), set(live))
        self._groups_since_index += 1
        if self._groups_since_index >= self.index_interval_groups:
            self._write_index()
        return []

    def _write_index(self) -> None:
        groups = [[gid, [[h.hex(), e.offset, e.nbytes, e.crc, str(e.dtype), list(e.shape)]
                         for h in sorted(g.block_hashes) for e in (self._entries[h],)]]
                  for gid, g in self._groups.items()]
        doc = {"format": _INDEX_FORMAT, "namespace": self.namespace,
               "next_group_id": self._next_group_id, "groups": groups}
        tmp = self.path / (_INDEX_NAME + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.fchmod(fd, 0o600)
                _write_all(fd, json.dumps(doc, separators=(",", ":")).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path / _INDEX_NAME)
        except OSError as exc:
            self._disable(f"writing the index failed: {exc}")
            return
        self._groups_since_index = 0

    def _disable(self, why: str) -> None:
        if self.is_enabled:
            logger.warning("disk tier: spilling disabled: %s", why)
        self.is_enabled = False

    def _load_index(self) -> None:
        """Adopt the blocks the index names whose files still hold them; delete everything else."""
        index_path = self.path / _INDEX_NAME
        if index_path.exists():
            try:
                self._adopt(json.loads(index_path.read_bytes()))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                logger.warning("disk tier: index %s ignored (%s); starting empty", index_path, exc)
                self._entries.clear()
                self._groups.clear()
                self._used_bytes = 0
        for p in self.path.iterdir():
            is_group = p.suffix == _GROUP_SUFFIX and p.stem.isdigit()
            if (is_group and int(p.stem) not in self._groups) or p.name.endswith(".tmp"):
                p.unlink()  # orphans of a crash, or of an index that could not be used
        self._next_group_id = max([self._next_group_id, *(gid + 1 for gid in self._groups)])
        while self._used_bytes > self.capacity_bytes and self._groups:
            self._evict_group(next(iter(self._groups)))

    def _adopt(self, doc: dict) -> None:
        if doc["format"] != _INDEX_FORMAT or doc["namespace"] != self.namespace:
            raise ValueError("format or namespace differs")
        self._next_group_id = int(doc["next_group_id"])
        for gid, blocks in doc["groups"]:  # least recently used first
            try:
                file_nbytes = self._group_path(gid).stat().st_size
            except FileNotFoundError:
                continue
            group = _Group(file_nbytes)
            for hex_hash, offset, nbytes, crc, dtype, shape in blocks:
                if offset + nbytes <= file_nbytes:  # a truncated file loses only its tail
                    h = bytes.fromhex(hex_hash)
                    self._entries[h] = _Entry(gid, offset, nbytes, crc, _dtype_from_name(dtype),
                                              tuple(shape))
                    group.block_hashes.add(h)
            if group.block_hashes:
                self._groups[gid] = group
                self._used_bytes += file_nbytes
