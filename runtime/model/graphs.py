"""The decode step a CUDA graph replays: static buffers, padded batch sizes, one capture per size.

A pure decode step (every scheduled sequence computes one new token, its block table no wider than
the buffers, no residency hooks, no recurrent layers, nothing asked of it but the logits of its
last tokens) is written into persistent device buffers (token ids, positions, KV slots, block
tables, context lengths) at the padded batch size row padding gives its sequence count
(runtime.model.row_padding), and the lean decoder's Triton loop (runtime.model.gpu_layers) and the
head run on them. On a CUDA device each padded size is captured once as a CUDA graph, the largest
first, all sharing one memory pool (vLLM's FULL_DECODE_ONLY), and a step replays its size's graph;
elsewhere (the CPU twin the tests run in Triton's interpreter) the same static-buffer step runs
eagerly. Any other step runs the runner's eager path, decided per step.

The padded rows are throwaway: token 0 at position 0, its key written to the scratch block and
attended from there alone. Each row of every kernel and matmul is computed from its own inputs only
(row padding is the guarantee for the matmuls), so a real row's logits are the bits the eager path
gives it, whatever the padding (tested on the CPU; `python -m bench.gpu` checks replay against eager
bit for bit on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from runtime.model.attention import AttentionMetadata, DecodeRows
from runtime.model.row_padding import RowPadding
from scheduler.scheduler import ScheduledSequence
from storage.kv_cache import KVCache

MAX_GRAPH_ROWS = 64  # the largest decode step (in sequences, before padding) a graph holds


class DecodeGraphs:
    """Static decode buffers and, on a CUDA device, one captured graph per padded batch size."""

    def __init__(self, decoder, cache: KVCache, padding: RowPadding, max_rows: int = MAX_GRAPH_ROWS,
                 max_blocks: int | None = None, capture: bool | None = None) -> None:
        """`max_blocks`: the widest block table a step may have (default: every block of the cache);
        `capture`: capture graphs (default: on a CUDA device; False runs the static step eagerly)."""
        if decoder is None or decoder.gpu is None or cache.scratch_block is None or not padding.max_rows:
            raise ValueError("a decode graph needs the lean decoder's Triton loop, row padding and a scratch block")
        self.decoder, self.cache = decoder, cache
        self.sizes = sorted({padding.pad(n) for n in range(1, min(max_rows, padding.max_rows) + 1)})
        self.padding = padding
        self.max_rows = min(max_rows, padding.max_rows)
        self.max_blocks = max_blocks or cache.num_blocks
        self.capture = cache.device.type == "cuda" if capture is None else capture
        device, largest = cache.device, self.sizes[-1]
        kv_heads = cache.shape.num_kv_heads
        self.input_ids = torch.zeros((1, largest), dtype=torch.long, device=device)
        self.positions = torch.zeros((1, largest), dtype=torch.long, device=device)
        self.slot_rows = torch.zeros((2, largest, kv_heads), dtype=torch.long, device=device)
        self.tables = torch.full((largest, self.max_blocks), cache.scratch_block, dtype=torch.long, device=device)
        self.ctx = torch.ones(largest, dtype=torch.long, device=device)
        self.rows = torch.arange(largest, device=device)
        self.logits: dict[int, torch.Tensor] = {}  # each size's output (a graph's static output on CUDA)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._scratch_slots()
        if self.capture:
            self._capture_all()

    def covers(self, scheduled: Seq[ScheduledSequence], every_row_of: Seq) -> bool:
        """Whether this step is a pure decode step the static buffers hold."""
        return 0 < len(scheduled) <= self.max_rows and not every_row_of and all(
            e.num_new_tokens == 1 and len(e.seq.block_table) <= self.max_blocks for e in scheduled)

    def run(self, scheduled: Seq[ScheduledSequence]) -> torch.Tensor:
        """The logits `[len(scheduled), vocab]` (the model's dtype) of the step's one new token each."""
        size = self.padding.pad(len(scheduled))
        self._fill(scheduled, size)
        if self.capture:
            self.graphs[size].replay()
            logits = self.logits[size]
        else:
            logits = self._step(size)
        return logits[:len(scheduled)]

    def _fill(self, scheduled: Seq[ScheduledSequence], size: int) -> None:
        n, bs = len(scheduled), self.cache.block_size
        ids, positions, blocks, offsets, widest = [], [], [], [], 1
        for entry in scheduled:
            seq = entry.seq
            position = seq.num_computed_tokens
            ids.append(seq.token_ids[position])
            positions.append(position)
            blocks.append(seq.block_table[position // bs])
            offsets.append(position % bs)
            widest = max(widest, len(seq.block_table))
        tables = torch.full((n, widest), self.cache.scratch_block, dtype=torch.long)
        for i, entry in enumerate(scheduled):
            tables[i, :len(entry.seq.block_table)] = torch.tensor(entry.seq.block_table)
        to = self.cache.device
        position_t = torch.tensor(positions)
        self.input_ids[0, :n].copy_(torch.tensor(ids), non_blocking=True)
        self.positions[0, :n].copy_(position_t, non_blocking=True)
        self.ctx[:n].copy_(position_t + 1, non_blocking=True)
        self.slot_rows[:, :n].copy_(self.cache.row_index(torch.tensor(blocks), torch.tensor(offsets)).to(to))
        self.tables[:n, :widest].copy_(tables.to(to))
        if n < size:  # the padded rows: throwaway tokens at position 0 in the scratch block (see `_scratch_slots`)
            self.input_ids[0, n:size] = 0
            self.positions[0, n:size] = 0
            self.ctx[n:size] = 1
            self.tables[n:size, 0] = self.cache.scratch_block
            self.slot_rows[:, n:size] = self._pad_slots[:, :size - n]

    def _scratch_slots(self) -> None:
        scratch = torch.full((self.sizes[-1],), self.cache.scratch_block)
        self._pad_slots = self.cache.row_index(scratch, torch.zeros_like(scratch)).to(self.cache.device)
        self.slot_rows.copy_(self._pad_slots)

    def _step(self, size: int) -> torch.Tensor:
        """The static-buffer step at padded size `size`: the lean decoder's Triton loop and the head."""
        meta = AttentionMetadata(self.cache, self.slot_rows[:, :size], [], [],
                                 decode_rows=DecodeRows(self.rows[:size], self.tables[:size], self.ctx[:size],
                                                        self.decoder.gpu.attention_kernel, widen=False))
        ids, positions = self.input_ids[:, :size], self.positions[:, :size]
        return self.decoder.logits(ids, positions, meta, self.rows[:size])

    def _capture_all(self) -> None:
        pool = None
        stream = torch.cuda.Stream(self.cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for size in reversed(self.sizes):  # the largest first: the smaller ones fit in its pool
                self._step(size)  # compile and warm every kernel outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[size] = self._step(size)
                pool = graph.pool() if pool is None else pool
                self.graphs[size] = graph
        torch.cuda.current_stream(self.cache.device).wait_stream(stream)
        torch.cuda.synchronize(self.cache.device)
