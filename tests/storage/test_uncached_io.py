"""Disk-tier reads past the page cache: O_DIRECT where the file system allows it, else dropped
pages; the bytes and checksums are the same as a plain read."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from storage import uncached_io
from storage.block_hash import hash_block
from storage.disk_tier import DiskTier
from storage.uncached_io import FADVISE, O_DIRECT, PAGE_CACHE, read_file

SHAPE = (2, 2, 2, 16, 8)  # 2048 bytes a float16 block: a group of 3 ends off the 4096 alignment


def name(i: int) -> bytes:
    return hash_block(None, [i], b"test")


def payload(i: int) -> torch.Tensor:
    return (torch.arange(torch.Size(SHAPE).numel()) + 1000 * i).reshape(SHAPE).to(torch.float16)


def filled_tier(root, **kw) -> DiskTier:
    tier = DiskTier(root, "ns", 1 << 20, blocks_per_group=3, reuse_buffer_groups=0, **kw)
    for i in range(6):
        tier.put(name(i), payload(i))
    return tier


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_reads_use_o_direct_and_return_the_written_bytes(tmp_path):
    tier = filled_tier(tmp_path, uncached_reads=True)
    assert tier.read_path == O_DIRECT
    for i in (0, 4, 2, 5):
        assert torch.equal(tier.get(name(i)), payload(i))
    assert tier.read_path == O_DIRECT and tier.num_group_reads == 4  # no reuse buffer: every get reads
    tier.check_integrity()


@pytest.mark.parametrize("length", [1, 4095, 4096, 4097, 3 * 2048, 10000])
def test_an_o_direct_read_of_any_length_returns_exactly_the_file(tmp_path, length):
    path = tmp_path / "f"
    data = bytes((i * 7) % 251 for i in range(length))
    path.write_bytes(data)
    got, used = read_file(path, length, O_DIRECT)
    assert bytes(got) == data and used in (O_DIRECT, FADVISE)
    assert bytes(read_file(path, length + 5000, O_DIRECT)[0]) == data  # asked past the end: the file
    assert bytes(read_file(path, length, PAGE_CACHE)[0]) == data


def test_a_refused_o_direct_falls_back_to_dropping_pages(tmp_path, monkeypatch):
    real_open = os.open
    advised = []

    def refusing_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(uncached_io.os, "open", refusing_open)
    monkeypatch.setattr(uncached_io.os, "posix_fadvise", lambda fd, off, n, advice: advised.append(advice),
                        raising=False)
    monkeypatch.setattr(uncached_io.os, "O_DIRECT", 0o40000, raising=False)
    tier = filled_tier(tmp_path, uncached_reads=True)
    assert advised == [os.POSIX_FADV_DONTNEED] * 2  # each group file's pages, once written
    assert torch.equal(tier.get(name(1)), payload(1))
    assert tier.read_path == FADVISE and advised[-1] == os.POSIX_FADV_DONTNEED and len(advised) == 3
    assert torch.equal(tier.get(name(3)), payload(3)) and len(advised) == 4  # no O_DIRECT retried


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no tmpfs at /dev/shm")
def test_on_tmpfs_the_tier_reads_through_dropped_pages(tmp_path_factory):
    root = Path("/dev/shm") / f"ponder-test-{os.getpid()}-{tmp_path_factory.getbasetemp().name}"
    try:
        tier = filled_tier(root, uncached_reads=True)
        assert torch.equal(tier.get(name(2)), payload(2))
        assert tier.read_path in (FADVISE, O_DIRECT)  # tmpfs refuses O_DIRECT on most kernels
    finally:
        import shutil
        shutil.rmtree(root, ignore_errors=True)


def test_a_corrupt_block_read_uncached_is_a_miss_never_served(tmp_path):
    tier = filled_tier(tmp_path, uncached_reads=True)
    group = sorted(p for p in tier.path.iterdir() if p.suffix == ".kvg")[0]
    raw = bytearray(group.read_bytes())
    raw[2048 + 10] ^= 0xFF  # inside the group's second block
    group.write_bytes(bytes(raw))
    assert tier.get(name(1)) is None and not tier.contains(name(1))
    assert torch.equal(tier.get(name(0)), payload(0))  # its neighbours are intact
    tier.check_integrity()


def test_without_the_setting_reads_go_through_the_page_cache(tmp_path):
    tier = filled_tier(tmp_path)
    assert tier.read_path == PAGE_CACHE
    assert torch.equal(tier.get(name(5)), payload(5))
