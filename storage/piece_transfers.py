"""Moves KV pieces (one layer, or one (layer, KV-head group), of a block) between the compute tier
and the tier chain on one background thread, in submission order.

One worker keeps a piece written back before it is loaded again findable, and keeps disk reads
sequential. Loads run in batches (one per layer or slice), so the per-piece cost is a chain call,
not a future. Time the caller spends blocked in `wait` is stall. A piece no tier holds, or one that
fails its disk checksum (the disk tier drops it and reports a miss), raises `PieceLost` from
`wait`: nothing is ever computed from it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from storage.block_hash import BlockHash
from storage.tiers import TierChain, TransferEngine


class PieceLost(RuntimeError):
    """A piece the compute needs is in no tier (or failed its checksum); `name` says which."""

    def __init__(self, name: BlockHash) -> None:
        super().__init__(f"KV piece {name.hex()} is in no tier")
        self.name = name


class PiecePipeline(TransferEngine):
    """The transfer engine's worker, stream and stall count, moving named pieces in batches."""

    def __init__(self, chain: TierChain, device: torch.device) -> None:
        super().__init__(chain, device=device)

    def load(self, pieces: Sequence[tuple[BlockHash, torch.Tensor]]) -> Future:
        """Copy each named piece into its tensor (a compute slot or a staging buffer)."""
        ready = None
        if self._is_cuda:  # the destinations may still be read by work queued on the compute stream
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        return self._executor.submit(self._load, list(pieces), ready)

    def write_back(self, pieces: Sequence[tuple[BlockHash, torch.Tensor]]) -> Future:
        """Demote host-side copies of pieces (the caller copied them off the compute tier)."""
        return self._executor.submit(self._write_back, list(pieces))

    def discard(self, names: Sequence[BlockHash]) -> Future:
        return self._executor.submit(self._discard, list(names))

    def wait(self, future: Future) -> None:
        """Block until `future` is done (the time counts as stall); raise what it raised."""
        if not future.done():
            start = time.perf_counter()
            try:
                future.exception()
            finally:
                self._add_stall(time.perf_counter() - start)
        future.result()

    def drain(self) -> None:
        """Wait until everything submitted so far is done."""
        self._executor.submit(lambda: None).result()

    # ---- worker side ---------------------------------------------------------------------------
    def _load(self, pieces: list[tuple[BlockHash, torch.Tensor]], ready) -> None:
        if self._stream is None:
            self._fetch_all(pieces)
            return
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            self._fetch_all(pieces)
        self._stream.synchronize()

    def _fetch_all(self, pieces: list[tuple[BlockHash, torch.Tensor]]) -> None:
        for name, out in pieces:
            if self.chain.fetch(name, out) is None:
                raise PieceLost(name)

    def _write_back(self, pieces: list[tuple[BlockHash, torch.Tensor]]) -> None:
        for name, payload in pieces:
            self.chain.demote(name, payload)

    def _discard(self, names: list[BlockHash]) -> None:
        for name in names:
            self.chain.discard(name)
