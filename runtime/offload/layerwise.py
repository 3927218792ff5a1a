"""The paper's baseline (`token`): every beam advances token by token, and the KV over the budget is
offloaded per layer and reloaded for every token (layer-wise offloading, with prefetch of the next
layer).

Memory follows the paper's Eq. 1 with its per-beam layout (a beam's KV is its own, as in a batched
per-beam cache, so a prefix shared by several beams is held and moved once per beam): before each
token, with P the blocks one layer of all beams spans,

    resident layers L = min(num_layers, floor(budget_blocks * num_layers / P))

(a block is num_layers layer pieces). Layers below L stay in the compute tier. For layers from L
up, every full block of every beam is reloaded for this token from the host/disk chain into a
staging buffer, one layer at a time: the load of layer l+1 runs while layer l computes, two
layer-sized buffers alternating (the buffers are working space outside the budget, as Eq. 1 has
no term for them). The block each beam is writing stays in the compute tier for every layer
(its write buffer); when it fills, its pieces of the offloaded layers are written back once. When
L falls, the newly offloaded layers of every full block are written back. L never rises within a
search (P only grows; a budget that grows on a GPU is left unused rather than reloading layers
that the next token's P may offload again).

So the bytes into compute per token are `(num_layers - L) * sum over beams of (blocks - 1)`
pieces: Eq. 2 less the block being written. Offloaded layers of full blocks are zeroed in the
compute tensor, so no result can come from anywhere but the reload. The compute tensor is sized
for every live block (its allocation is not what is measured; Eq. 1 charges the resident layers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from runtime.offload.names import BlockNames
from runtime.offload.pipeline import LayerPipeline
from runtime.offload.runner import DecodeEntry, OffloadRunner
from runtime.offload.search import Advance, BeamState, StepStats
from scheduler.kv_manager import KVManager
from scheduler.sequence import Sequence
from storage.block_hash import BlockHash
from storage.kv_cache import KVCache
from storage.tiers import piece_key


def resident_layers(num_layers: int, budget_blocks: int, layer_blocks: int) -> int:
    """Eq. 1: layers whose KV (`layer_blocks` pieces each) fits in `budget_blocks` blocks."""
    if layer_blocks <= 0:
        return num_layers
    return min(num_layers, budget_blocks * num_layers // layer_blocks)


class _Staging:
    """One forward's per-layer reloads: layer l's pieces land in buffer l % 2."""

    def __init__(self, policy: "LayerwisePolicy", first_layer: int,
                 fulls: list[list[int]]) -> None:
        self.policy = policy
        self.first_layer = first_layer
        rows_of: dict[int, list[tuple[int, int]]] = {}
        for row, blocks in enumerate(fulls):
            for j, block in enumerate(blocks):
                rows_of.setdefault(block, []).append((row, j))
        # Block order (the order pieces were written back in) with the copies of one piece for
        # several beams together, so the disk tier's reuse buffer serves the repeats.
        order = [(block, row, j) for block in sorted(rows_of) for row, j in rows_of[block]]
        self._names = [policy.names.of(block) for block, _, _ in order]
        self._dests = [[buffer[:, :, row, j] for _, row, j in order] for buffer in policy.staging]
        self._futures = {}
        for layer in (first_layer, first_layer + 1):
            self._submit(layer)

    def staged(self, layer: int) -> torch.Tensor:
        self._submit(layer + 1)  # its buffer was last read by layer - 1, which is done
        self.policy.pipeline.wait(self._futures.pop(layer))
        return self.policy.staging[layer % 2]

    def _submit(self, layer: int) -> None:
        if layer >= self.policy.num_layers or layer in self._futures or layer < self.first_layer:
            return
        pieces = [(piece_key(name, layer, 0), dest)
                  for name, dest in zip(self._names, self._dests[layer % 2])]
        self.policy.bytes_prefetched += len(pieces) * self.policy.piece_bytes
        self._futures[layer] = self.policy.pipeline.load(pieces)


class LayerwisePolicy:
    def __init__(self, cache: KVCache, pipeline: LayerPipeline, runner: OffloadRunner,
                 kv: KVManager, names: BlockNames, step_tokens: int, num_beams: int,
                 max_blocks: int, *, budget: Callable[[], int]) -> None:
        self.cache = cache  # indexed by logical block id
        self.pipeline = pipeline
        self.runner = runner
        self.kv = kv
        self.names = names
        self.step_tokens = step_tokens
        self.budget = budget
        self.block_size = kv.block_size
        self.num_layers = cache.shape.num_layers
        self.num_resident = self.num_layers
        self.sealed: set[int] = set()  # full blocks: their offloaded layers live below compute
        self.piece_bytes = cache.bytes_per_block // self.num_layers
        shape = cache.shape
        # Per buffer [K/V, kv_heads, beam, block, offset, head_dim]: the attention reads a layer's
        # keys for all beams as one slice.
        self.staging = torch.zeros((2, 2, shape.num_kv_heads, num_beams, max(1, max_blocks),
                                    shape.block_size, shape.head_dim),
                                   dtype=cache.dtype, device=cache.device)
        self.bytes_prefetched = 0
        self.writeback_seconds = 0.0  # copying pieces off the compute tier before a write-back
        self.resident_per_step: list[int] = []

    def piece_names(self, block_id: int, layer: int) -> BlockHash:
        return piece_key(self.names.of(block_id), layer, 0)

    # ---- the search's calls --------------------------------------------------------------------
    def prefill(self, seq: Sequence) -> torch.Tensor:
        if resident_layers(self.num_layers, self.budget(), len(seq.block_table)) < self.num_layers:
            raise MemoryError("the prompt's KV does not fit in the compute tier")
        logits = self.runner.prefill(self.cache, seq.token_ids, seq.block_table)
        self._seal(seq.block_table[:len(seq.token_ids) // self.block_size])
        return logits

    def copy_block(self, src: int, dst: int, beam: BeamState) -> None:
        self.cache.copy_blocks([(src, dst)])  # a partial block: every layer is in compute

    def forget(self, block_ids: Iterable[int]) -> None:
        names = []
        for block_id in block_ids:
            self.sealed.discard(block_id)
            name = self.names.pop(block_id)
            if name is not None:
                names += [piece_key(name, layer, 0) for layer in range(self.num_layers)]
        if names:
            self.pipeline.discard(names)

    def run_step(self, beams: list[BeamState], advance: Advance) -> StepStats:
        bs = self.block_size
        lowest = self.num_layers
        for _ in range(self.step_tokens):
            tables = [b.seq.block_table[:b.seq.num_computed_tokens // bs + 1] for b in beams]
            layer_blocks = sum(len(t) for t in tables)
            fits = resident_layers(self.num_layers, self.budget(), layer_blocks)
            self._offload_layers_from(min(self.num_resident, fits))
            lowest = min(lowest, self.num_resident)
            entries = [DecodeEntry(b.seq.token_ids[-1], b.seq.num_computed_tokens, tuple(t), row)
                       for row, (b, t) in enumerate(zip(beams, tables))]
            staging = None
            if self.num_resident < self.num_layers:
                staging = _Staging(self, self.num_resident, [t[:-1] for t in tables])
            logits = self.runner.decode(self.cache, entries, staging)
            advance(beams, logits)
            self._seal([t[-1] for b, t in zip(beams, tables) if b.seq.num_computed_tokens % bs == 0])
        self.resident_per_step.append(lowest)
        return StepStats((len(beams),), (layer_blocks,), self.budget())

    # ---- internals -----------------------------------------------------------------------------
    def _offload_layers_from(self, num_resident: int) -> None:
        if num_resident < self.num_resident:
            self._write_back(sorted(self.sealed), range(num_resident, self.num_resident))
            self.num_resident = num_resident

    def _seal(self, block_ids: list[int]) -> None:
        """Blocks just filled: write back their offloaded layers once."""
        if not block_ids:
            return
        self.sealed.update(block_ids)
        if self.num_resident < self.num_layers:
            self._write_back(sorted(block_ids), range(self.num_resident, self.num_layers))

    def _write_back(self, block_ids: list[int], layers: range) -> None:
        if not block_ids or not layers:
            return
        start = time.perf_counter()
        ids = torch.tensor(block_ids, device=self.cache.device)
        host = self.cache.kv[ids, layers.start:layers.stop].to("cpu", copy=True)
        # Layer-major, so a disk group holds one layer of several blocks, as a reload reads them.
        pieces = [(self.piece_names(b, layer), host[i, layer - layers.start])
                  for layer in layers for i, b in enumerate(block_ids)]
        self.pipeline.write_back(pieces)
        self.cache.kv[ids, layers.start:layers.stop] = 0
        self.writeback_seconds += time.perf_counter() - start
