"""Head-wise serving (`[scheduler] kv_granularity = "head"`): a plain request (one choice) whose KV
does not fit the compute pool is served by streaming (layer, KV-head group) pieces through it from
the host tier, the disk tier below it (runtime.kv.headwise).

Such a request waits until no other sequence holds a compute block, then has the compute tier to
itself: the prefix cache is emptied (into the lower tiers, when they are attached) and the engine's
KV tensor is lent whole to the head-wise store, whose tensors never exceed it. One engine step runs
one forward of it: a prefill chunk, or one decoded token. Its pieces below compute live in tiers of
their own, as large as the host and disk tiers attached to the engine, created for the request and
dropped after it. It is refused (admission) only when even those cannot hold it.

A piece that is gone or fails its disk checksum is never served: the request's KV is rebuilt by
running the same forwards again (prompt chunks, then its tokens one by one), which gives the same
bits, and it goes on.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections import deque

import torch

from runtime.kv.head_pieces import PiecePlan, plan_pieces
from runtime.kv.headwise import HeadwiseDecoder
from runtime.kv.host import StreamHost
from runtime.kv.sequence_owner import SequenceOwner
from runtime.model.sampler import sample
from scheduler.sequence import Sequence
from storage.disk_tier import DiskTier
from storage.host_tier import HostTier
from storage.piece_transfers import PieceLost
from storage.tiers import TierChain

log = logging.getLogger("ponder.runtime")


class StreamedRequests:
    def __init__(self, host: StreamHost, model, config, model_key: bytes, group_heads: int = 1) -> None:
        """`config`: the engine's settings (the compute budget `num_blocks`, `max_num_batched_tokens`,
        `max_model_len`)."""
        shape = host.cache.shape
        self.host = host
        self.model = model
        self.model_key = model_key
        self.max_model_len = config.max_model_len
        self.group_heads = group_heads
        self.num_slices = shape.num_layers * (shape.num_kv_heads // group_heads)
        self.budget_pieces = config.num_blocks * self.num_slices
        self.piece_shape = (2, group_heads, shape.block_size, shape.head_dim)
        self.piece_bytes = host.cache.bytes_per_block // (self.num_slices * group_heads) * group_heads
        self.prefill_chunk = max(shape.block_size, config.max_num_batched_tokens)
        self.queue: deque[Sequence] = deque()
        self.seq: Sequence | None = None  # the request running now
        self.decoder: HeadwiseDecoder | None = None
        self._workdir: str | None = None
        self.bytes_done: dict[str, int] = {}  # transfer counters of finished requests
        self.stall_done = 0.0
        self.num_rebuilt = 0  # KV rebuilds after a lost or corrupt piece
        self.tokens_generated = 0

    # ---- sizes ---------------------------------------------------------------------------------
    def plan(self, num_tokens: int) -> PiecePlan:
        """The pieces of a sequence of `num_tokens` tokens; MemoryError if it cannot stream."""
        shape = self.host.cache.shape
        return plan_pieces(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                           group_heads=self.group_heads, head_dim=shape.head_dim,
                           block_size=shape.block_size, max_tokens=num_tokens,
                           budget_pieces=self.budget_pieces, prefetch=True)

    def _tier_bytes(self) -> tuple[int, int]:
        chain = self.host.tier_chain
        if chain is None:
            return 0, 0
        return (chain.host.capacity_bytes if chain.host is not None else 0,
                chain.disk.capacity_bytes if chain.disk is not None and chain.disk.is_enabled else 0)

    def fits(self, num_tokens: int) -> bool:
        try:
            plan = self.plan(num_tokens)
        except MemoryError:
            return False
        below = self.num_slices * (num_tokens // plan.block_size) - plan.resident_pieces
        return below * self.piece_bytes <= sum(self._tier_bytes())

    def max_tokens(self) -> int:
        """The most tokens of KV one streamed sequence may hold (0: none)."""
        low, high = 0, self.max_model_len
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.fits(mid) else (low, mid - 1)
        return low

    # ---- requests ------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.seq is not None or bool(self.queue)

    def add(self, seq: Sequence) -> None:
        self.host.scheduler.hold(seq)  # known to the scheduler (finish, abort), never scheduled
        self.queue.append(seq)

    def step(self) -> bool:
        """Run one forward of the streamed request, if one can run now; whether one ran."""
        while self.seq is not None and self.seq.is_finished:  # aborted
            self._end()
        while self.seq is None and self.queue and self.host.pool.num_used == 0:
            seq = self.queue.popleft()
            if not seq.is_finished:
                self._start(seq)
        if self.seq is None:
            return False
        seq = self.seq
        try:
            logits = self._forward(seq)
        except PieceLost as lost:
            log.warning("%s; rebuilding the streamed request's KV", lost)
            self._rebuild(seq)
            return True
        if logits is not None:
            self._sample(seq, logits)
        if seq.is_finished:
            self._end()
        return True

    # ---- internals -----------------------------------------------------------------------------
    def _forward(self, seq: Sequence, replay: bool = False) -> torch.Tensor | None:
        """The next forward: a prompt chunk or the last token. Logits when a token is due."""
        done = self.decoder.num_tokens
        prompt = seq.num_prompt_tokens
        if done < prompt:
            end = min(prompt, done + self.prefill_chunk)
            logits = self.decoder.forward(seq.token_ids[done:end])
            return logits if end == prompt else None
        return self.decoder.forward([seq.token_ids[done]])

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> None:
        owner: SequenceOwner = seq.owner
        owner.on_logits(seq, logits)
        (out,) = sample(logits[None], [seq.owner.sampling],
                        [(seq.token_ids[:seq.num_prompt_tokens], seq.output_token_ids)])
        seq.append_token(out.token_id)
        seq.num_computed_tokens = self.decoder.num_tokens
        self.tokens_generated += 1
        owner.on_sampled(seq, out)

    def _start(self, seq: Sequence) -> None:
        cache = self.host.cache
        self.host.pool.reset_prefix_cache()  # the compute tier is lent whole: nothing cached survives
        if self.host.residency is not None:
            self.host.residency.drain()
        plan = self.plan(len(seq.token_ids) + seq.owner.request.max_tokens - 1)
        host_bytes, disk_bytes = self._tier_bytes()
        chain = self.host.tier_chain
        needed = plan.total_pieces * self.piece_bytes
        host = HostTier(self.piece_shape, cache.dtype, min(host_bytes, needed),
                        pin_memory=cache.device.type == "cuda", name=chain.host.name) \
            if host_bytes > 0 else None
        disk = None
        compute = chain.compute_name if chain is not None else ("gpu" if cache.device.type == "cuda" else "cpu")
        if disk_bytes > 0:
            self._workdir = tempfile.mkdtemp(prefix="streamed-", dir=chain.disk.path.parent)
            disk = DiskTier(self._workdir, f"streamed|{self.piece_shape}", disk_bytes, name=chain.disk.name,
                            uncached_reads=chain.disk.read_path != "page_cache")
        # A streamed context is read once per token in order: promoting disk hits into a host
        # tier too small for it would only evict what the next slice reads.
        pieces = TierChain(host, disk, compute_name=compute, promote_disk_hits=False)
        extra_key = self.model_key + f"|streamed{seq.seq_id}|gh{self.group_heads}".encode()
        self.seq = seq
        self.decoder = HeadwiseDecoder(self.model, plan, pieces, cache.kv, extra_key)

    def _rebuild(self, seq: Sequence) -> None:
        """Start the KV over and run the same forwards again, up to where it was."""
        self.num_rebuilt += 1
        target = self.decoder.num_tokens
        self._close_decoder()
        self._start(seq)
        while self.decoder.num_tokens < target:
            self._forward(seq)

    def _close_decoder(self) -> None:
        decoder, self.decoder = self.decoder, None
        if decoder is not None:
            decoder.close()
            for pair, n in decoder.chain.bytes_moved.items():
                self.bytes_done[pair] = self.bytes_done.get(pair, 0) + n
            self.stall_done += decoder.pipeline.stall_seconds
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def _end(self) -> None:
        self._close_decoder()
        self.seq = None

    # ---- counters ------------------------------------------------------------------------------
    def bytes_moved(self) -> dict[str, int]:
        out = dict(self.bytes_done)
        if self.decoder is not None:
            for pair, n in self.decoder.chain.bytes_moved.items():
                out[pair] = out.get(pair, 0) + n
        return out

    @property
    def stall_seconds(self) -> float:
        return self.stall_done + (self.decoder.pipeline.stall_seconds if self.decoder is not None else 0.0)
