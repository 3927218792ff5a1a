"""The paper's layer-wise baseline (`[scheduler] policy = "token"` with tiers attached): every path
advances token by token together, and the KV over the compute budget is offloaded per layer and
reloaded for every token, the next layer's reload running while this layer computes.

Memory follows the paper's Eq. 1 with its per-path layout (a path's KV is its own, as in a batched
per-path cache, so a block shared by several paths counts, and moves, once per path): with P the
blocks one layer of all the step's paths spans,

    resident layers L = min(num_layers, floor(budget_blocks * num_layers / P))

Layers below L stay in the compute tier. For each layer from L up, each path's every full block is
loaded from the host/disk chain into its compute slot before the layer computes and given back
(zeroed) after it, so the bytes into compute per token are Eq. 2, `(num_layers - L) * P` pieces,
less the blocks being written (they stay in compute for every layer until full, then their
offloaded layers are written back once). A block records the layers it has below compute (from
`low` up); when L falls, a block read this step writes back the newly offloaded layers, and when L
rises, loads them back for good. The compute tensor is sized for every block the paths may hold
(`Engine` grows the logical pool over what the tiers hold); offloaded layers are zeroed in it, so
no result can come from anywhere but a reload, and Eq. 1 charges only the resident layers.

A piece is named `piece_key(name, layer, 0)` with a name minted per incarnation of a block (the
pool's generation), so a copy below compute of a dead block is never served as a new one. A piece
that is gone or fails its disk checksum raises `PieceLost` before anything reads it; the engine
then gives up every path holding that block and recomputes it (`recover`).

It is a residency (runtime.kv.residency): the runner settles a step's blocks through `begin_step`,
and the attention calls `before_layer` and `after_layer` around each layer (its `LayerStep`).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from scheduler.scheduler import Scheduler
from storage.block_hash import BlockHash, hash_block
from storage.block_pool import BlockPool
from storage.kv_cache import KVCache, KVShape
from storage.piece_transfers import PieceLost, PiecePipeline
from storage.tiers import TierChain, piece_key


def resident_layers(num_layers: int, budget_blocks: int, layer_blocks: int) -> int:
    """Eq. 1: layers whose KV (`layer_blocks` pieces each) fits in `budget_blocks` blocks."""
    if layer_blocks <= 0:
        return num_layers
    return min(num_layers, budget_blocks * num_layers // layer_blocks)


@dataclass
class _Sealed:
    name: BlockHash  # this incarnation's name below compute
    generation: int  # the pool generation it describes
    low: int  # layers from `low` up live below compute, zeroed in the compute slot
    below: int  # layers from `below` (<= low) up have a copy below compute


class BlockLost(PieceLost):
    """A full block's piece is gone: `block_id` must be recomputed by every path holding it."""

    def __init__(self, name: BlockHash, block_id: int) -> None:
        super().__init__(name)
        self.block_id = block_id


class LayerwiseResidency:
    def __init__(self, cache: KVCache, pool: BlockPool, chain: TierChain, budget_blocks: int,
                 extra_key: bytes = b"") -> None:
        self.cache = cache
        self.pool = pool
        self.chain = chain
        self.budget_blocks = budget_blocks
        self.extra_key = extra_key
        self.pipeline = PiecePipeline(chain, cache.device)
        self.num_layers = cache.shape.num_layers
        self.num_resident = self.num_layers  # L of the last step
        self.piece_bytes = cache.bytes_per_block // self.num_layers
        self.sealed: dict[int, _Sealed] = {}
        self._serials = itertools.count()
        self.num_loaded = 0  # pieces loaded into compute
        self.num_written = 0  # pieces written back
        self.num_lost = 0  # blocks recomputed because a piece of them was gone or corrupt
        self.sync_seconds = 0.0  # restores and write-back copies made on the engine's thread
        self._step: LayerStep | None = None  # the step under way, when its layers reload

    def stall_seconds(self) -> float:
        return self.pipeline.stall_seconds + self.sync_seconds

    def bytes_moved(self) -> dict[str, int]:
        return self.chain.bytes_moved  # a copy

    def promote_prefix(self, seq, limit: int | None = None) -> int:
        """Nothing to promote: a block's pieces are named per incarnation, never looked up by prefix."""
        return 0

    def drain(self) -> None:
        self.pipeline.drain()

    def block_counts(self) -> dict[str, int]:
        return {}  # no block below compute is named

    def check_integrity(self) -> None:
        self.chain.check_integrity()

    def record(self, block_id: int) -> _Sealed | None:
        """What is known of the block's current incarnation, if it was sealed."""
        rec = self.sealed.get(block_id)
        return rec if rec is not None and rec.generation == self.pool.generations[block_id] else None

    # ---- one step ------------------------------------------------------------------------------
    def attention(self, scheduled) -> None:
        return None  # every step's KV is in the pool's blocks, their layers reloaded around each layer

    def begin_step(self, scheduled, copies) -> bool:
        """Settle the blocks the step reads to this step's L; whether its layers reload (not when
        every layer is resident and nothing below compute is read)."""
        bs = self.cache.block_size
        reads: list[int] = []  # per path, its full blocks before the step (a shared one per path)
        filling: list[int] = []  # blocks this step fills
        layer_blocks = 0
        for entry in scheduled:
            seq = entry.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + entry.num_new_tokens
            reads += seq.block_table[:start // bs]
            filling += seq.block_table[start // bs:end // bs]
            if start % bs:  # a sealed block written again (a cut fork): all its layers come back
                self._restore(seq.block_table[start // bs], self.num_layers)
            layer_blocks += -(-end // bs)
        for src, dst in copies:  # a copy of a sealed block lacks its offloaded layers
            rec = self.record(src)
            if rec is not None and rec.low < self.num_layers:
                self._load_sync([(piece_key(rec.name, layer, 0), self.cache.kv[dst, layer], src)
                                 for layer in range(rec.low, self.num_layers)])
        first = resident_layers(self.num_layers, self.budget_blocks, layer_blocks)
        self.num_resident = first
        for block in dict.fromkeys(reads):
            self._settle(block, first)
        self._seal(filling, first)
        self._step = LayerStep(self, first, reads, filling) if first < self.num_layers else None
        return self._step is not None

    def before_layer(self, layer: int) -> None:
        if self._step is not None:
            self._step.before(layer)

    def after_layer(self, layer: int) -> None:
        if self._step is not None:
            self._step.after(layer)

    def end_step(self) -> None:
        self._step = None

    def _settle(self, block: int, first: int) -> None:
        rec = self.record(block)
        if rec is None:
            raise AssertionError(f"block {block} is read as full but was never sealed")
        if rec.low < first:
            self._restore(block, first)
        elif rec.low > first:  # layers already below are only given back, never written twice
            self._write_back([block], range(first, min(rec.low, rec.below)))
            self.cache.kv[block, first:rec.low] = 0
            rec.low = rec.below = min(rec.below, first)

    def _restore(self, block: int, up_to: int) -> None:
        """Load the block's layers [low, up_to) back into compute for good."""
        rec = self.record(block)
        if rec is None or rec.low >= up_to:
            return
        self._load_sync([(piece_key(rec.name, layer, 0), self.cache.kv[block, layer], block)
                         for layer in range(rec.low, up_to)])
        rec.low = up_to

    def _seal(self, blocks: list[int], first: int) -> None:
        """Blocks this step fills: a fresh name, their layers from `first` up written back once
        computed (`LayerStep.after`)."""
        stale = []
        for block in blocks:
            old = self.sealed.get(block)
            if old is not None:
                stale += [piece_key(old.name, layer, 0) for layer in range(old.below, self.num_layers)]
            name = hash_block(None, [next(self._serials)], self.extra_key)
            self.sealed[block] = _Sealed(name, self.pool.generations[block], first, first)
        if stale:
            self.pipeline.discard(stale)

    def forget(self, block_id: int) -> None:
        """The block's contents are lost: forget its record and whatever is left of it below."""
        rec = self.sealed.pop(block_id, None)
        self.num_lost += 1
        if rec is not None:
            self.pipeline.discard([piece_key(rec.name, layer, 0)
                                   for layer in range(rec.below, self.num_layers)])

    def recover(self, lost: BlockLost, scheduler: Scheduler) -> None:
        """A block whose KV is gone: every path holding it gives its blocks up and is recomputed, and
        the block's name is forgotten, so no prefix lookup serves it."""
        self.forget(lost.block_id)
        self.pool.forget_name(lost.block_id)
        for seq in list(scheduler.running) + list(scheduler.parked):
            if lost.block_id in seq.block_table:
                scheduler.give_up_blocks(seq)

    def close(self) -> None:
        self.pipeline.close()

    # ---- transfers on the engine's thread ------------------------------------------------------
    def _load_sync(self, pieces: list[tuple[BlockHash, torch.Tensor, int]]) -> None:
        began = time.perf_counter()
        future = self.pipeline.load([(name, out) for name, out, _ in pieces])
        self.num_loaded += len(pieces)
        try:
            future.result()
        except PieceLost as lost:
            raise BlockLost(lost.name, next(b for n, _, b in pieces if n == lost.name)) from None
        finally:
            self.sync_seconds += time.perf_counter() - began

    def _write_back(self, blocks: list[int], layers: range) -> None:
        if not blocks or not layers:
            return
        began = time.perf_counter()
        ids = torch.tensor(blocks, device=self.cache.device)
        host = self.cache.kv[ids, layers.start:layers.stop].to("cpu", copy=True)
        pieces = [(piece_key(self.sealed[b].name, layer, 0), host[i, layer - layers.start])
                  for layer in layers for i, b in enumerate(blocks)]
        self.pipeline.write_back(pieces)
        self.num_written += len(pieces)
        self.cache.kv[ids, layers.start:layers.stop] = 0
        self.sync_seconds += time.perf_counter() - began


class LayerStep:
    """One forward's per-layer reloads, which the residency's `before_layer` and `after_layer` run:
    `before(layer)` waits for the layer's pieces (and starts the next layer's), `after(layer)`
    writes back the layer's pieces of the blocks just filled and gives every offloaded piece back."""

    def __init__(self, residency: LayerwiseResidency, first_layer: int, reads: list[int],
                 filling: list[int]) -> None:
        self.residency = residency
        self.first_layer = first_layer
        self.reads = sorted(reads)  # copies of one block together, as they were written back
        self.filling = filling
        self.touched = torch.tensor(sorted(set(reads) | set(filling)), dtype=torch.long,
                                    device=residency.cache.device)
        self._futures = {}
        self._done: list[int] = []  # layers whose `after` ran: the filled blocks' pieces went below
        self._submit(first_layer)

    def before(self, layer: int) -> None:
        if layer < self.first_layer:
            return
        self._submit(layer + 1)  # its slots were given back by the previous step
        try:
            self.residency.pipeline.wait(self._futures.pop(layer))
        except PieceLost as lost:
            self.abandon()
            block = next(b for b in self.reads if self.residency.sealed[b].name == lost.name[:-4])
            raise BlockLost(lost.name, block) from None

    def after(self, layer: int) -> None:
        if layer < self.first_layer:
            return
        res = self.residency
        if self.filling:
            res._write_back(self.filling, range(layer, layer + 1))
        self._done.append(layer)
        if len(self.touched):
            res.cache.kv[self.touched, layer] = 0

    def abandon(self) -> None:
        """The forward stops: let the loads in flight finish, give every loaded piece back, and
        bring the filled blocks' written-back layers home (the step runs again, and seals them
        again under new names)."""
        res = self.residency
        for future in self._futures.values():
            future.exception()
        self._futures.clear()
        reads = sorted(set(self.reads) - set(self.filling))
        if reads:
            res.cache.kv[torch.tensor(reads, device=res.cache.device), self.first_layer:] = 0
        names = [(piece_key(res.sealed[b].name, layer, 0), res.cache.kv[b, layer], b)
                 for layer in self._done for b in self.filling]
        if names:
            res._load_sync(names)
            res.pipeline.discard([name for name, _, _ in names])
        for block in self.filling:
            res.sealed[block].low = res.sealed[block].below = res.num_layers

    def _submit(self, layer: int) -> None:
        res = self.residency
        if layer >= res.num_layers or layer in self._futures:
            return
        pieces = [(piece_key(res.sealed[b].name, layer, 0), res.cache.kv[b, layer]) for b in self.reads]
        res.num_loaded += len(pieces)
        self._futures[layer] = res.pipeline.load(pieces)


def logical_blocks(chain: TierChain, shape: KVShape, dtype: torch.dtype, config) -> int:
    """Blocks the paths may hold under `token`: as many as the tiers below compute hold every layer
    of (at least the compute budget, `config.num_blocks`), and no more than `max_num_seqs` sequences
    of `max_model_len` tokens could ever use."""
    below = chain.disk.capacity_bytes // shape.bytes_per_block(dtype) if chain.disk is not None else 0
    if chain.host is not None:
        if chain.host.block_shape != shape.block_shape[1:]:
            raise ValueError(f"under policy token the host tier holds one layer of a block, shape "
                             f"{shape.block_shape[1:]}, not {chain.host.block_shape}")
        below += chain.host.num_slots // shape.num_layers
    most = config.max_num_seqs * -(-config.max_model_len // config.block_size)
    return max(config.num_blocks, min(below, most))
