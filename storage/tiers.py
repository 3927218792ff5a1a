"""The tiers below the compute pool, and the engine that moves blocks through them off the hot path.

compute ("gpu") -> host ("cpu") -> disk ("disk"): a block evicted from the compute pool is demoted
to the host tier; what the host tier evicts cascades to disk; a fetch serves from whichever tier
holds the block. The compute pool belongs to the KV cache and is seen here only as a name and an
optional residency callback. Every tier names a block by its chained hash.

Blocks move whole (`kv[block_id]`), or as head-group pieces (`kv[block_id, layer, :, h0:h1]`,
after HeadInfer) when a tier is built for the piece shape and the pieces are named by `piece_key`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from storage.block_hash import BlockHash
from storage.disk_tier import DiskTier
from storage.host_tier import HostTier


def piece_key(block_hash: BlockHash, layer: int, head_group: int) -> BlockHash:
    """Name of one (layer, KV-head group) piece of a block, distinct from every block name."""
    return block_hash + layer.to_bytes(2, "little") + head_group.to_bytes(2, "little")


class TierChain:
    """Owns the host and disk tiers, the cascade between them and the bytes moved between tiers.

    One lock serialises every operation, so the transfer engine's worker and the engine loop can
    share a chain; disk I/O under the lock is bounded by one group read or write.
    """

    def __init__(self, host: HostTier | None, disk: DiskTier | None, *, compute_name: str = "gpu",
                 is_compute_resident: Callable[[BlockHash], bool] | None = None,
                 promote_disk_hits: bool = True) -> None:
        self.host = host
        self.disk = disk
        self.compute_name = compute_name
        self.promote_disk_hits = promote_disk_hits
        self._is_compute_resident = is_compute_resident
        self._lock = threading.RLock()
        names = [compute_name] + [t.name for t in (host, disk) if t is not None]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must differ, got {names}")
        self._bytes = {(s, d): 0 for s in names for d in names if s != d}

    @property
    def bytes_moved(self) -> dict[str, int]:
        """Bytes moved per ordered tier pair, as {"src/dst": bytes}, zero pairs included."""
        with self._lock:
            return {f"{s}/{d}": n for (s, d), n in self._bytes.items()}

    def lookup(self, block_hash: BlockHash) -> str | None:
        """Name of the highest tier holding the block, or None."""
        if self._is_compute_resident is not None and self._is_compute_resident(block_hash):
            return self.compute_name
        with self._lock:
            for tier in (self.host, self.disk):
                if tier is not None and tier.contains(block_hash):
                    return tier.name
        return None

    def demote(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        """Take a block the compute pool evicts, into the host tier (or disk, without one).

        The payload is copied; the caller may reuse its memory as soon as this returns. Where the
        block ends up, if anywhere (a full, disabled disk keeps nothing), `lookup` tells.
        """
        with self._lock:
            host = self.host
            if host is None or host.num_slots == 0:
                self._spill(self.compute_name, block_hash, payload)
            elif host.contains(block_hash):
                host.put(block_hash, payload)  # only marks it used
            else:
                self._count(self.compute_name, host.name, payload)
                for old_hash, old_payload in host.put(block_hash, payload):
                    self._spill(host.name, old_hash, old_payload)

    def fetch(self, block_hash: BlockHash, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The block's payload for the compute tier, or None if no tier below compute holds it.

        With `out` the payload is copied into it (a compute-pool slot, say) and `out` is returned;
        without, the result is a tensor the caller owns. A disk hit is promoted to the host tier
        when `promote_disk_hits` (counted disk->host, then host->compute).
        """
        with self._lock:
            found = self._locate(block_hash)
            if found is None:
                return None
            src_tier, payload, is_owned = found
            self._count(src_tier, self.compute_name, payload)
            if out is not None:
                out.copy_(payload)
                return out
            return payload if is_owned else payload.clone()

    def persist(self, block_hash: BlockHash, payload: torch.Tensor, src: str) -> None:
        """Write a block held in tier `src` to the disk tier now, so it outlives this process."""
        with self._lock:
            self._spill(src, block_hash, payload)

    def persist_host(self) -> None:
        """Write every block the host tier holds to the disk tier."""
        with self._lock:
            if self.host is None:
                return
            for block_hash in self.host.lru_order():
                payload = self.host.get(block_hash)
                if payload is not None:
                    self._spill(self.host.name, block_hash, payload)

    def discard(self, block_hash: BlockHash) -> None:
        """Forget the block in every tier below compute."""
        with self._lock:
            for tier in (self.host, self.disk):
                if tier is not None:
                    tier.discard(block_hash)

    def flush(self) -> list[BlockHash]:
        """Persist what the disk tier still holds in memory; return the names a failed write lost."""
        with self._lock:
            return self.disk.flush() if self.disk is not None else []

    def check_integrity(self) -> None:
        with self._lock:
            for tier in (self.host, self.disk):
                if tier is not None:
                    tier.check_integrity()
            assert all(n >= 0 for n in self._bytes.values()), "a byte counter went negative"

    # ---- internals (called with the lock held) -------------------------------------------------
    def _count(self, src: str, dst: str, payload: torch.Tensor) -> None:
        self._bytes[(src, dst)] += payload.numel() * payload.element_size()

    def _spill(self, src: str, block_hash: BlockHash, payload: torch.Tensor) -> None:
        """Hand a block to the disk tier, counting the bytes only if it was written there."""
        disk = self.disk
        if disk is None:
            return
        was_held = disk.contains(block_hash)
        disk.put(block_hash, payload)  # a held name is only marked used
        if not was_held and disk.contains(block_hash):
            self._count(src, disk.name, payload)

    def _locate(self, block_hash: BlockHash) -> tuple[str, torch.Tensor, bool] | None:
        """(tier it is served from, payload, whether the payload is already the caller's own)."""
        host = self.host
        if host is not None:
            payload = host.get(block_hash)
            if payload is not None:
                return host.name, payload, False  # a view into the host slab
        payload = self.disk.get(block_hash) if self.disk is not None else None
        if payload is None:
            return None
        if not self.promote_disk_hits or host is None or host.num_slots == 0 \
                or tuple(payload.shape) != host.block_shape or payload.dtype != host.dtype:
            return self.disk.name, payload, True
        self._count(self.disk.name, host.name, payload)
        for old_hash, old_payload in host.put(block_hash, payload):
            self._spill(host.name, old_hash, old_payload)
        return host.name, payload, True


class PrefetchHandle:
    """Blocks being fetched in the background, awaited one by one."""

    def __init__(self, futures: dict[BlockHash, Future],
                 add_stall: Callable[[float], None]) -> None:
        self._futures = futures
        self._add_stall = add_stall

    @property
    def hashes(self) -> list[BlockHash]:
        return list(self._futures)

    def is_ready(self, block_hash: BlockHash) -> bool:
        return self._futures[block_hash].done()

    def wait(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The fetched payload (None on a miss); time spent blocked here counts as stall."""
        future = self._futures[block_hash]
        if future.done():
            return future.result()
        start = time.perf_counter()
        try:
            return future.result()
        finally:
            self._add_stall(time.perf_counter() - start)


class TransferEngine:
    """Moves blocks between the compute tier and the chain on one background thread.

    One worker keeps disk reads and writes sequential and in submission order, so a block offloaded
    before it is prefetched is found. With CUDA, host<->device copies run on a side stream: the side
    stream waits for the compute stream's event before filling a slot, and the compute stream waits
    for the copy-out event before it may overwrite an offloaded slot.
    """

    def __init__(self, chain: TierChain, *, device: torch.device | str | None = None) -> None:
        self.chain = chain
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._is_cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._is_cuda else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-transfer")
        self._stall_lock = threading.Lock()
        self._stall_seconds = 0.0

    @property
    def stall_seconds(self) -> float:
        """Seconds callers spent blocked in `PrefetchHandle.wait`."""
        with self._stall_lock:
            return self._stall_seconds

    def prefetch(self, hashes: Iterable[BlockHash],
                 out: Mapping[BlockHash, torch.Tensor] | None = None) -> PrefetchHandle:
        """Start fetching blocks in order; `out` maps a name to the tensor to fill (a pool slot)."""
        out = out or {}
        compute_stream = ready = None
        if self._is_cuda:  # slots may still be read by work already queued on the compute stream
            compute_stream = torch.cuda.current_stream(self.device)
            ready = torch.cuda.Event()
            ready.record(compute_stream)
        futures = {h: self._executor.submit(self._fetch_one, h, out.get(h), ready, compute_stream)
                   for h in dict.fromkeys(hashes)}
        return PrefetchHandle(futures, self._add_stall)

    def offload(self, block_hash: BlockHash, payload: torch.Tensor) -> Future:
        """Demote a block in the background; the caller may reuse `payload`'s memory at once.

        The future completes when the block is in the chain.
        """
        copied = None
        if self._stream is not None and payload.is_cuda:
            compute_stream = torch.cuda.current_stream(payload.device)
            staging = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
            self._stream.wait_stream(compute_stream)  # the slot's contents are written first
            with torch.cuda.stream(self._stream):
                staging.copy_(payload, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self._stream)
            payload.record_stream(self._stream)
            compute_stream.wait_event(copied)  # and not overwritten before they are copied out
        else:
            staging = payload.detach().to("cpu", copy=True)
        return self._executor.submit(self._demote_one, block_hash, staging, copied)

    def close(self) -> None:
        """Finish queued transfers, then stop the worker."""
        self._executor.shutdown(wait=True)

    # ---- worker side ---------------------------------------------------------------------------
    def _fetch_one(self, block_hash: BlockHash, out: torch.Tensor | None, ready, compute_stream
                   ) -> torch.Tensor | None:
        if self._stream is None:
            return self.chain.fetch(block_hash, out)
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            # Blocking copies (copy_ without non_blocking synchronises the side stream): the data
            # is on the device when they return, and the host slot they read may be reused.
            if out is not None:
                return self.chain.fetch(block_hash, out)
            payload = self.chain.fetch(block_hash)
            if payload is None:
                return None
            on_device = payload.to(self.device)
        on_device.record_stream(compute_stream)  # allocated on the side stream, used on compute
        return on_device

    def _demote_one(self, block_hash: BlockHash, staging: torch.Tensor,
                    copied: torch.cuda.Event | None) -> None:
        if copied is not None:
            copied.synchronize()
        self.chain.demote(block_hash, staging)

    def _add_stall(self, seconds: float) -> None:
        with self._stall_lock:
            self._stall_seconds += seconds
