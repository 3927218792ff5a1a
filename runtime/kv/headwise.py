"""Head-wise residency (`[scheduler] kv_granularity = "head"`, after HeadInfer): a plain request (one
choice) whose KV does not fit the compute pool streams (layer, KV-head group) pieces through it from
host and disk tiers, and decoding stays exact. The third residency (runtime.kv.residency).

Such a request waits until no other sequence holds a compute block, then has the compute tier to
itself: the prefix cache is emptied (into the tiers below, when attached) and the engine's KV tensor
is lent whole to its `HeadwiseStore` (runtime.kv.head_pieces). While it runs, `schedule` is the
engine's plan: one forward a step, a prefill chunk or one token, executed, sampled and handed to the
request's owner like any other step; its sequence holds no pool block, so the runner leaves every
layer's attention to `attention`. Its pieces below compute live in tiers of their own, as large as
the host and disk tiers attached to the engine, made for the request and dropped after it; it is
refused (admission) only when even those cannot hold it.

Per forward, per layer, per KV-head group (a slice): the slice's pieces are loaded into a staging
buffer (the next slice's load runs while this one computes), the query heads of that group attend
the slice's whole context, and the new full blocks are written back (or kept, if resident).
Exactness: each head attends its full context with one softmax, through SDPA's math backend, whose
per-head result does not depend on which heads share the call (the fused CPU and CUDA kernels split
work by head count, which changes the last bits). So the logits do not depend on the budget, the
group size or the tiers, and greedy tokens match transformers' `generate`.

A piece that is gone or fails its disk checksum raises `PieceLost` before anything reads it; the
engine calls `recover`, which rebuilds the KV by running the same forwards again (prompt chunks, then
its tokens one by one): the same bits, and it goes on. The engine holds one residency: under
`kv_granularity = "head"` this one, which owns the tiers attached below the compute pool (`tiers`: a
`TieredPrefixCache`, or a `LayerwiseResidency` under `token`); every other step, the prefix cache's
promotions and the counters go through to them, its own counters added.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Sequence as Seq

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from runtime.kv.head_pieces import HeadwiseStore, NoFit, PiecePlan, plan_pieces
from runtime.kv.host import StreamHost
from runtime.kv.residency import Residency
from scheduler.scheduler import Scheduler, ScheduledSequence, SchedulerOutput
from scheduler.sequence import Sequence
from storage.disk_tier import DiskTier
from storage.host_tier import HostTier
from storage.piece_transfers import PieceLost, PiecePipeline
from storage.tiers import TierChain


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """`[1, H, T, D]` queries over `[1, KVH, ctx, D]` keys/values; every head's math is the same
    whichever heads share the call."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                              enable_gqa=True)


class HeadwiseResidency:
    def __init__(self, host: StreamHost, config, model_key: bytes, group_heads: int = 1) -> None:
        """`config`: the engine's settings (the compute budget `num_blocks`, `max_num_batched_tokens`,
        `max_model_len`)."""
        shape = host.cache.shape
        self.host = host
        self.model_key = model_key
        self.max_model_len = config.max_model_len
        self.group_heads = group_heads
        self.num_slices = shape.num_layers * (shape.num_kv_heads // group_heads)
        self.budget_pieces = config.num_blocks * self.num_slices
        self.piece_shape = (2, group_heads, shape.block_size, shape.head_dim)
        self.piece_bytes = host.cache.bytes_per_block // (self.num_slices * group_heads) * group_heads
        self.prefill_chunk = max(shape.block_size, config.max_num_batched_tokens)
        self.tiers: Residency | None = None  # the tiers below the compute pool, once attached
        self.queue: deque[Sequence] = deque()
        self.seq: Sequence | None = None  # the request streaming now
        self.store: HeadwiseStore | None = None  # its KV
        self._workdir: str | None = None
        self._forward: tuple[int, int, torch.Tensor | None] = (0, 0, None)  # start, end, mask of the step
        self.bytes_done: dict[str, int] = {}  # transfer counters of finished requests
        self.stall_done = 0.0
        self.num_rebuilt = 0  # KV rebuilds after a lost or corrupt piece

    # ---- sizes ---------------------------------------------------------------------------------
    def plan(self, num_tokens: int) -> PiecePlan | NoFit:
        """The pieces of a sequence of `num_tokens` tokens, or why it cannot stream."""
        shape = self.host.cache.shape
        return plan_pieces(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                           group_heads=self.group_heads, head_dim=shape.head_dim,
                           block_size=shape.block_size, max_tokens=num_tokens,
                           budget_pieces=self.budget_pieces, prefetch=True)

    def _tier_bytes(self) -> tuple[int, int]:
        host, disk = (chain.host, chain.disk) if (chain := self.chain) is not None else (None, None)
        return (host.capacity_bytes if host is not None else 0,
                disk.capacity_bytes if disk is not None and disk.is_enabled else 0)

    def fits(self, num_tokens: int) -> bool:
        plan = self.plan(num_tokens)
        if isinstance(plan, NoFit):
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
        self.host.scheduler.hold(seq)  # known to the scheduler (finish, abort), never scheduled by it
        self.queue.append(seq)

    def schedule(self) -> SchedulerOutput | None:
        """The step's plan while a streamed request has the compute tier to itself: its next forward.
        One waiting starts once no other sequence holds a compute block. None: none runs."""
        if self.seq is not None and self.seq.is_finished:  # done, or aborted
            self._end()
        while self.seq is None and self.queue and self.host.pool.num_used == 0:
            seq = self.queue.popleft()
            if not seq.is_finished:
                self._start(seq)
        return None if self.seq is None else SchedulerOutput([self._next(self.seq)])

    def _next(self, seq: Sequence) -> ScheduledSequence:
        """The next forward: a prompt chunk, or the last token."""
        done, prompt = seq.num_computed_tokens, seq.num_prompt_tokens
        return ScheduledSequence(seq, min(self.prefill_chunk, prompt - done) if done < prompt else 1)

    # ---- a step of the streamed request --------------------------------------------------------
    def attention(self, scheduled: Seq[ScheduledSequence]) -> Callable[..., torch.Tensor] | None:
        """For a step of the streamed request (its KV is here, in no pool block): its blocks are named
        and this residency attends every layer (`_attend`). None for any other step."""
        if self.seq is None or len(scheduled) != 1 or scheduled[0].seq is not self.seq:
            return None
        start = self.seq.num_computed_tokens
        end = start + scheduled[0].num_new_tokens
        self.store.begin(self.seq.token_ids[start:end], start)
        positions = torch.arange(end, device=self.host.cache.device)  # a chunk's query sees keys up to its own:
        self._forward = (start, end, positions[None, :] <= positions[start:end, None] if end - start > 1 else None)
        return self._attend

    def _attend(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                scaling: float | None) -> torch.Tensor:
        """Layer `layer` of the step, one KV-head group at a time over a staging buffer holding its
        whole context: queries `[T, H, D]`, the new keys and values `[T, KVH, D]`; returns `[T, H, D]`."""
        store, (start, end, mask) = self.store, self._forward
        plan = store.plan
        gh, rep = plan.group_heads, queries.shape[1] // keys.shape[1]  # query heads per KV head
        out = queries.new_empty(queries.shape)
        for group in range(plan.num_groups):
            s = layer * plan.num_groups + group
            kv_heads = slice(group * gh, (group + 1) * gh)
            q_heads = slice(group * gh * rep, (group + 1) * gh * rep)
            buf = store.acquire(s)
            buf[0, :, start:end] = keys[:, kv_heads].transpose(0, 1)
            buf[1, :, start:end] = values[:, kv_heads].transpose(0, 1)
            o = attend(queries[:, q_heads].transpose(0, 1)[None], buf[None, 0, :, :end], buf[None, 1, :, :end],
                       mask, scaling)
            out[:, q_heads] = o[0].transpose(0, 1)
            store.release(s, end)
        return out

    def recover(self, lost: PieceLost, scheduler: Scheduler) -> None:
        """A piece is gone: the streamed request's KV starts over and the same forwards run again, up
        to where it was (the same bits); any other step's loss is the tiers'."""
        if self.seq is None:
            return self.tiers.recover(lost, scheduler)
        seq, target = self.seq, self.seq.num_computed_tokens
        self.num_rebuilt += 1
        self._close_store()
        self._start(seq)
        seq.recompute()
        while seq.num_computed_tokens < target:
            entry = self._next(seq)
            self.host.runner.execute([entry], [], [])
            seq.computed(entry.num_new_tokens)

    def _start(self, seq: Sequence) -> None:
        cache = self.host.cache
        self.host.pool.reset_prefix_cache()  # the compute tier is lent whole: nothing cached survives
        self.drain()
        plan = self.plan(seq.num_prompt_tokens + seq.owner.request.max_tokens - 1)  # a rebuild's too
        if isinstance(plan, NoFit):  # admission streams only what `fits`
            raise RuntimeError(f"a streamed request admitted that cannot stream: {plan.reason}")
        host_bytes, disk_bytes = self._tier_bytes()
        chain = self.chain
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
        self.stream(seq, plan, TierChain(host, disk, compute_name=compute, promote_disk_hits=False))

    def stream(self, seq: Sequence, plan: PiecePlan, pieces: TierChain) -> None:
        """Run `seq` from now on over `plan`: its compute-tier tensors carved from the engine's KV
        tensor, its other pieces in `pieces`."""
        cache = self.host.cache
        extra_key = self.model_key + f"|streamed{seq.seq_id}|gh{plan.group_heads}".encode()
        self.seq = seq
        self.store = HeadwiseStore(plan, cache.kv, PiecePipeline(pieces, cache.device), extra_key)

    def _close_store(self) -> None:
        store, self.store = self.store, None
        if store is not None:
            store.pipeline.close()
            for pair, n in store.pipeline.chain.bytes_moved.items():
                self.bytes_done[pair] = self.bytes_done.get(pair, 0) + n
            self.stall_done += store.pipeline.stall_seconds
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def _end(self) -> None:
        self._close_store()
        self.seq = None

    # ---- every other step and the prefix cache: the tiers attached below the pool, if any -------
    def own(self, tiers: Residency) -> HeadwiseResidency:
        """Take the tiers attached below the compute pool (given to the engine at construction): it is their residency."""
        self.tiers = tiers
        return self

    @property
    def chain(self) -> TierChain | None:
        return self.tiers.chain if self.tiers is not None else None

    def begin_step(self, scheduled, copies) -> bool:
        return self.tiers is not None and self.tiers.begin_step(scheduled, copies)

    def before_layer(self, layer: int) -> None:
        self.tiers.before_layer(layer)

    def after_layer(self, layer: int) -> None:
        self.tiers.after_layer(layer)

    def end_step(self) -> None:
        if self.tiers is not None:
            self.tiers.end_step()

    def promote_prefix(self, seq: Sequence, limit: int | None = None) -> int:
        return self.tiers.promote_prefix(seq, limit) if self.tiers is not None else 0

    def drain(self) -> None:
        if self.tiers is not None:
            self.tiers.drain()

    def block_counts(self) -> dict[str, int]:
        return self.tiers.block_counts() if self.tiers is not None else {}

    def check_integrity(self) -> None:
        if self.tiers is not None:
            self.tiers.check_integrity()

    def close(self) -> None:
        self._end()
        if self.tiers is not None:
            self.tiers.close()

    def bytes_moved(self) -> dict[str, int]:
        """The tiers' counters and the streamed requests' (their own tiers), together."""
        moved = self.tiers.bytes_moved() if self.tiers is not None else {}
        for pair, n in [*self.bytes_done.items(),
                        *(self.store.pipeline.chain.bytes_moved.items() if self.store is not None else ())]:
            moved[pair] = moved.get(pair, 0) + n
        return moved

    def stall_seconds(self) -> float:
        return (self.tiers.stall_seconds() if self.tiers is not None else 0.0) + self.stall_done + \
            (self.store.pipeline.stall_seconds if self.store is not None else 0.0)
