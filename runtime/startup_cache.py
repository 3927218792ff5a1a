"""What a start-up computed, kept on disk so the next start reads it instead of computing it again.

One directory, `$XDG_CACHE_HOME/ponder` (default `~/.cache/ponder`), holds one entry per thing
cached: `kernels/` (ponder's built CPU kernels), `tokenizer/` (a GGUF's vocabulary converted to a
fast tokenizer) and `int4/` (a GGUF model's float tensors and its int4 layers already packed for the
kernel). An entry is a directory named by the hash of its key, holding `key.json` (the full key,
compared on every read) and its files; it appears in one rename, so a reader sees all of it or none.

Keys name everything the content depends on: the model file (path, size, modification time), the
hash of ponder's source files that compute it, the torch, transformers and gguf versions and the
CPU's vector unit. A change to any of them misses the old entry and builds a new one. The cache only
ever saves time: an entry that cannot be read (corrupt, truncated, another version's) is rebuilt,
and a cache directory that cannot be written (read-only, full) is logged once and start-up goes on.
Delete the directory to clear it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)

KEY_FILE = "key.json"
_RUNTIME = Path(__file__).parent
T = TypeVar("T")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ponder"


def file_identity(path: str | os.PathLike) -> dict:
    """What names one version of a file without reading it: its resolved path, size and mtime."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    return {"path": str(resolved), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def sources_hash(paths: Iterable[Path]) -> str:
    """sha256 over the named files' contents (in the order given)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def environment() -> dict:
    """The library versions and CPU features every entry depends on."""
    import torch

    versions = {"torch": torch.__version__, "isa": torch.backends.cpu.get_cpu_capability()}
    for name in ("transformers", "gguf", "tokenizers", "safetensors"):  # metadata only: importing costs seconds
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def runtime_sources(*names: str) -> list[Path]:
    return [_RUNTIME / name for name in names]


class Entry:
    """One cached thing under `root/kind/`, found by `key` (a JSON-able dict)."""

    def __init__(self, kind: str, key: dict, root: Path | None = None) -> None:
        self.kind = kind
        self.key = {**key, "environment": environment()}
        self.text = json.dumps(self.key, sort_keys=True)
        self.path = (root or cache_root()) / kind / hashlib.sha256(self.text.encode()).hexdigest()[:32]

    def is_present(self) -> bool:
        """Whether a complete entry for this key is on disk (its key file names this very key)."""
        try:
            return (self.path / KEY_FILE).read_text() == self.text
        except (OSError, UnicodeDecodeError):
            return False

    def read(self, reader: Callable[[Path], T]) -> T | None:
        """`reader(directory)`, or None when the entry is missing or cannot be read (then it is removed,
        so the caller's rebuild replaces it)."""
        if not self.is_present():
            return None
        try:
            return reader(self.path)
        except Exception as exc:  # noqa: BLE001 - any unreadable entry is rebuilt, never fatal
            log.warning("start-up cache: %s at %s cannot be read (%s: %s); rebuilding it",
                        self.kind, self.path, type(exc).__name__, exc)
            self.discard()
            return None

    def write(self, writer: Callable[[Path], None]) -> bool:
        """Fill a fresh directory with `writer(directory)` and move it into place; False (logged) when
        the cache cannot be written. A concurrent writer of the same key wins or loses whole."""
        parent = self.path.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=parent))
        except OSError as exc:
            log.warning("start-up cache: cannot write %s under %s (%s); starting without it", self.kind, parent, exc)
            return False
        try:
            writer(staging)
            if self.is_present():  # another process wrote it meanwhile: keep theirs, which may be in use
                shutil.rmtree(staging, ignore_errors=True)
                return True
            (staging / KEY_FILE).write_text(self.text)
            self.discard()  # a directory without this key file: a damaged entry
            os.rename(staging, self.path)
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be written only costs time
            shutil.rmtree(staging, ignore_errors=True)
            if self.is_present():  # another process wrote the same entry first
                return True
            log.warning("start-up cache: cannot write %s at %s (%s: %s); starting without it",
                        self.kind, self.path, type(exc).__name__, exc)
            return False
        self._prune()
        return True

    def _prune(self) -> None:
        """Remove the entries this one replaces: those of a model file that is gone or changed, or of
        another version of ponder or its libraries for the same file. Entries not naming a model
        (the kernels) stay, one per set of sources."""
        model = self.key.get("model")
        if not isinstance(model, dict):
            return
        for sibling in self.path.parent.iterdir():
            if sibling == self.path or sibling.name.startswith("."):
                continue
            try:
                other = json.loads((sibling / KEY_FILE).read_text())
                theirs = other["model"]
                stale = not Path(theirs["path"]).exists() or (theirs["path"] == model["path"] and (
                    theirs != model or other.get("code") != self.key.get("code")
                    or other.get("environment") != self.key["environment"]))
            except (OSError, ValueError, KeyError, TypeError):
                stale = True  # unreadable: a crashed writer's or a corrupt entry
            if stale:
                shutil.rmtree(sibling, ignore_errors=True)

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
