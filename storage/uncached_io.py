"""Reads that cost what a disk read costs: the page cache is bypassed or emptied first.

`O_DIRECT` reads into a page-aligned buffer whose length is a multiple of the device block, where the
file system allows it (tmpfs does not: its pages are the storage). Otherwise the file's cached pages
are dropped with POSIX_FADV_DONTNEED before the read (after a write, once the data is on disk, so
dirty pages, which cannot be dropped, are not left behind). `PAGE_CACHE` reads plainly.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

O_DIRECT = "o_direct"
FADVISE = "fadvise_dontneed"
PAGE_CACHE = "page_cache"
_ALIGN = 4096  # O_DIRECT: buffer address, file offset and length in multiples of the device block


def best_read_path(uncached: bool) -> str:
    """The read path to try first: O_DIRECT where the platform has it, else dropping pages."""
    if not uncached:
        return PAGE_CACHE
    if hasattr(os, "O_DIRECT"):
        return O_DIRECT
    return FADVISE if hasattr(os, "posix_fadvise") else PAGE_CACHE


def read_file(path: Path, nbytes: int, read_path: str) -> tuple[bytearray, str]:
    """(up to `nbytes` of the file, fewer if it is shorter; the read path used). An O_DIRECT open the
    file system refuses (EINVAL) falls back to FADVISE, which the caller keeps for later reads."""
    if read_path == O_DIRECT:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            read_path = FADVISE
        else:
            try:
                return _read_direct(fd, nbytes), O_DIRECT
            finally:
                os.close(fd)
    data = bytearray(nbytes)
    with open(path, "rb", buffering=0) as f:
        if read_path == FADVISE:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        n = f.readinto(data)
    del data[n or 0:]
    return data, read_path


def drop_written(fd: int, read_path: str) -> None:
    """After writing a file that will be read uncached: put it on disk and drop its cached pages."""
    if read_path != PAGE_CACHE and hasattr(os, "posix_fadvise"):
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _read_direct(fd: int, nbytes: int) -> bytearray:
    size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
    with mmap.mmap(-1, size) as buffer:  # an anonymous map is page-aligned
        view = memoryview(buffer)
        try:
            done = 0
            while done < nbytes:
                n = os.preadv(fd, [view[done:]], done)
                done += max(n, 0)
                if n <= 0 or done % _ALIGN:  # the end of the file (a short, unaligned tail)
                    break
            return bytearray(view[:min(done, nbytes)])
        finally:
            view.release()
