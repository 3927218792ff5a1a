"""Head-wise residency of one sequence's KV (after HeadInfer): which (block, layer, KV-head group)
pieces stay in the compute tier, and the compute-side store that stages the rest per slice.

A slice is one (layer, KV-head group): `group_heads` KV heads of one layer. A piece is one slice of
one full block, `[2 (K/V), group_heads, block_size, head_dim]`, named below compute by
`piece_key(chained block hash, layer, group)`. The compute tier holds, within `budget_pieces`:

    resident  the first `quotas[s]` full blocks of slice s, kept in place for the whole run
              (slices are filled in order, so the first slices are wholly resident, HeadInfer's
              "heads on the GPU", and at most one is partly resident)
    tail      per slice, the block being written (a write buffer of one piece)
    staging   `num_buffers` buffers of one slice's whole context (two with prefetch: slice i+1
              loads while slice i computes)

so `resident + num_slices + num_buffers * staging_pieces <= budget_pieces`, planned once for the
longest context the run reaches. Every other full piece lives in the tier chain and is loaded into
a staging buffer each time its slice computes: `loads(start)` pieces for a forward whose tokens
start at position `start`.

A budget that cannot hold a plan is a result, not an exception: `plan_pieces` returns `NoFit`, saying
why, and the caller decides (start-up names the setting, admission refuses the request, sizing
searches for the longest context that fits).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from storage.block_hash import BlockHash, hash_block
from storage.piece_transfers import PieceLost, PiecePipeline
from storage.tiers import piece_key


@dataclass(frozen=True)
class NoFit:
    """A compute budget that cannot stream a sequence: why, for the message its caller writes."""

    reason: str


@dataclass(frozen=True)
class PiecePlan:
    num_layers: int
    num_groups: int
    group_heads: int  # KV heads per group
    head_dim: int
    block_size: int
    max_tokens: int  # tokens whose KV the run ever holds
    num_buffers: int
    budget_pieces: int
    quotas: tuple[int, ...]  # per slice (layer-major): leading full blocks kept resident

    @property
    def num_slices(self) -> int:
        return self.num_layers * self.num_groups

    @property
    def staging_pieces(self) -> int:
        """Pieces one staging buffer holds: a slice's longest context, the partial block included."""
        return -(-self.max_tokens // self.block_size)

    @property
    def resident_pieces(self) -> int:
        return sum(self.quotas)

    @property
    def working_pieces(self) -> int:
        return self.resident_pieces + self.num_slices + self.num_buffers * self.staging_pieces

    @property
    def total_pieces(self) -> int:
        """The sequence's whole KV at its longest, in pieces (the partial block as a piece)."""
        return self.num_slices * self.staging_pieces

    def loads(self, start: int) -> int:
        """Pieces loaded into compute for a forward whose first token sits at `start`."""
        full = start // self.block_size
        return sum(max(0, full - q) for q in self.quotas)


def plan_pieces(*, num_layers: int, num_kv_heads: int, group_heads: int, head_dim: int,
                block_size: int, max_tokens: int, budget_pieces: int, prefetch: bool) -> PiecePlan | NoFit:
    if group_heads < 1 or num_kv_heads % group_heads:
        raise ValueError(f"group_heads {group_heads} must divide num_kv_heads {num_kv_heads}")
    num_slices = num_layers * (num_kv_heads // group_heads)
    num_buffers = 2 if prefetch else 1
    staging = -(-max_tokens // block_size)
    spare = budget_pieces - num_slices - num_buffers * staging
    if spare < 0:
        return NoFit(
            f"a compute tier of {budget_pieces} pieces cannot hold {num_slices} write buffers and "
            f"{num_buffers} staging buffers of {staging} pieces (one slice's context of "
            f"{max_tokens} tokens); raise the budget or use fewer KV heads per group")
    full = max_tokens // block_size
    quotas = tuple(min(full, max(0, spare - s * full)) if full else 0 for s in range(num_slices))
    return PiecePlan(num_layers, num_kv_heads // group_heads, group_heads, head_dim, block_size,
                     max_tokens, num_buffers, budget_pieces, quotas)


class HeadwiseStore:
    """Owns the compute tier's KV tensors for one sequence and the names of its full blocks.

    Per forward (tokens `[start, end)`), each slice in layer-major order: `acquire` returns its
    staging buffer holding the context before `start`; the attention writes the new tokens into it;
    `release` keeps the newly full blocks (resident ones in place, the rest written back) and the
    partial block in the tail.
    """

    def __init__(self, plan: PiecePlan, arena: torch.Tensor, pipeline: PiecePipeline,
                 extra_key: bytes) -> None:
        """`arena`: the flat compute-tier memory the store's tensors are carved from (the engine's
        KV tensor, lent whole while the sequence runs)."""
        self.plan = plan
        self.pipeline = pipeline
        self.extra_key = extra_key
        bs, gh, d = plan.block_size, plan.group_heads, plan.head_dim
        free = arena.view(-1)

        def carve(*shape: int) -> torch.Tensor:
            nonlocal free
            n = math.prod(shape)
            if n > free.numel():  # the plan fits its budget, and the arena is that budget: a bug
                raise RuntimeError(f"the compute tier has {free.numel()} elements left, {n} are needed")
            out, free = free[:n].view(shape), free[n:]
            return out.zero_()

        self.resident = [carve(2, gh, q * bs, d) for q in plan.quotas]
        self.tail = carve(plan.num_slices, 2, gh, bs, d)
        self.staging = [carve(2, gh, plan.staging_pieces * bs, d) for _ in range(plan.num_buffers)]
        self.piece_bytes = 2 * gh * bs * d * self.tail.element_size()
        self.block_names: list[BlockHash] = []  # chained names of the full blocks, in order
        self.num_loaded = 0
        self.num_written = 0
        self.loads_per_forward: list[int] = []  # what the plan says each forward loads
        self.writeback_seconds = 0.0
        self._token_ids: list[int] = []
        self._futures: dict[int, Future] = {}
        self._start = 0

    @property
    def compute_bytes(self) -> int:
        """Bytes of every KV tensor the compute tier holds (what the budget limits)."""
        tensors = [*self.resident, self.tail, *self.staging]
        return sum(t.numel() * t.element_size() for t in tensors)

    def begin(self, token_ids: Sequence[int], start: int) -> None:
        """A forward of `token_ids` at positions `start`...; names the blocks it fills."""
        if start != len(self._token_ids) or self._futures:
            raise RuntimeError(f"a forward at {start} after {len(self._token_ids)} tokens")
        if start + len(token_ids) > self.plan.max_tokens:
            raise RuntimeError(f"{start + len(token_ids)} tokens exceed the planned "
                              f"{self.plan.max_tokens}")
        self._token_ids.extend(token_ids)
        self._start = start
        self.loads_per_forward.append(self.plan.loads(start))
        bs = self.plan.block_size
        parent = self.block_names[-1] if self.block_names else None
        for j in range(len(self.block_names), len(self._token_ids) // bs):
            parent = hash_block(parent, self._token_ids[j * bs:(j + 1) * bs], self.extra_key)
            self.block_names.append(parent)

    def acquire(self, s: int) -> torch.Tensor:
        """Slice s's staging buffer `[2, group_heads, capacity, head_dim]`, its first `start`
        tokens filled: loaded pieces, resident pieces, then the tail."""
        if s not in self._futures:
            self._submit(s)
        if self.plan.num_buffers > 1 and s + 1 < self.plan.num_slices:
            self._submit(s + 1)  # its buffer was last read by slice s - 1, released already
        try:
            self.pipeline.wait(self._futures.pop(s))
        except PieceLost:
            self.abandon()
            raise
        buf = self.staging[s % self.plan.num_buffers]
        bs, start = self.plan.block_size, self._start
        full = start // bs
        held = min(self.plan.quotas[s], full) * bs
        buf[:, :, :held] = self.resident[s][:, :, :held]
        buf[:, :, full * bs:start] = self.tail[s][:, :, :start - full * bs]
        return buf

    def release(self, s: int, end: int) -> None:
        """Keep what slice s's forward wrote into its buffer, tokens `[start, end)`."""
        bs, start = self.plan.block_size, self._start
        buf = self.staging[s % self.plan.num_buffers]
        layer, group = divmod(s, self.plan.num_groups)
        quota = self.plan.quotas[s]
        out = []
        began = time.perf_counter()
        for j in range(start // bs, end // bs):
            piece = buf[:, :, j * bs:(j + 1) * bs]
            if j < quota:
                self.resident[s][:, :, j * bs:(j + 1) * bs] = piece
            else:  # a host copy, so the buffer may be refilled before the write completes
                out.append((piece_key(self.block_names[j], layer, group),
                            piece.to("cpu", copy=True).contiguous()))
        if out:
            self.pipeline.write_back(out)
            self.num_written += len(out)
        self.writeback_seconds += time.perf_counter() - began
        full = end // bs
        self.tail[s][:, :, :end - full * bs] = buf[:, :, full * bs:end]

    def _submit(self, s: int) -> None:
        bs = self.plan.block_size
        full = self._start // bs
        layer, group = divmod(s, self.plan.num_groups)
        buf = self.staging[s % self.plan.num_buffers]
        pieces = [(piece_key(self.block_names[j], layer, group), buf[:, :, j * bs:(j + 1) * bs])
                  for j in range(min(self.plan.quotas[s], full), full)]
        self.num_loaded += len(pieces)
        self._futures[s] = self.pipeline.load(pieces)

    def abandon(self) -> None:
        """The forward stops: let the loads in flight finish."""
        for future in self._futures.values():
            future.exception()
        self._futures.clear()

    def check_integrity(self) -> None:
        plan = self.plan
        assert not self._futures, "a slice was loaded and never computed"
        assert len(self.block_names) == len(self._token_ids) // plan.block_size
        assert plan.working_pieces <= plan.budget_pieces, "the plan exceeds the budget"
        assert self.compute_bytes == plan.working_pieces * self.piece_bytes, (
            f"compute tier holds {self.compute_bytes} bytes, planned "
            f"{plan.working_pieces * self.piece_bytes}")
