"""The decode step a CUDA graph replays: static buffers, padded batch sizes, one capture per size.

A pure decode step (every scheduled sequence computes one new token, its block table no wider than
the buffers, no residency hooks, no recurrent layers, nothing asked of it but the logits of its
last tokens) is written into persistent device buffers (token ids, positions, KV slots, block
tables, context lengths) at the padded batch size row padding gives its sequence count
(runtime.model.row_padding): two copies from host buffers a step (pinned on CUDA), the tables and the
rest, and the lean decoder's Triton loop (runtime.model.gpu_layers) and the
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
        # Token ids, positions, context lengths and KV slot rows: views of one device buffer, written a step
        # by one copy of its host mirror (pinned on CUDA); block tables a second copy.
        pinned = self.capture
        self._host = torch.zeros(largest * (3 + 2 * kv_heads), dtype=torch.long, pin_memory=pinned)
        flat = torch.zeros_like(self._host, device=device)
        self._flat = flat
        self.input_ids, self.positions = flat[:largest].view(1, largest), flat[largest:2 * largest].view(1, largest)
        self.ctx, self.slot_rows = flat[2 * largest:3 * largest], flat[3 * largest:].view(2, largest, kv_heads)
        host = self._host.numpy()
        self._ids, self._positions, self._ctx = host[:largest], host[largest:2 * largest], host[2 * largest:3 * largest]
        self._slots = host[3 * largest:].reshape(2, largest, kv_heads)
        # a slot's rows are its block times `_block_rows`, plus its offset, plus the pattern `[2, KVH]`
        origin = torch.zeros(1, dtype=torch.long)
        self._pattern = cache.row_index(origin, origin)[:, 0].numpy()
        self._block_rows = cache.shape.num_layers * cache.layer_rows
        self._pad_slots = self._pattern + cache.scratch_block * self._block_rows  # (block `scratch`, offset 0)
        self._tables_host = torch.empty(0, dtype=torch.long)
        self._copied = torch.cuda.Event() if pinned else None  # the last step's copies out of the host buffers
        self.tables = torch.full((largest, self.max_blocks), cache.scratch_block, dtype=torch.long, device=device)
        self.rows = torch.arange(largest, device=device)
        self.logits: dict[int, torch.Tensor] = {}  # each size's output (a graph's static output on CUDA)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pad(0, largest)
        flat.copy_(self._host)
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
        n, bs, rows = len(scheduled), self.cache.block_size, self._block_rows
        if self._copied is not None:
            self._copied.synchronize()  # (the host buffers' last copies are done before they are rewritten)
        widest = max(len(entry.seq.block_table) for entry in scheduled)
        tables = self._host_tables(size, widest)
        tables.fill(self.cache.scratch_block)
        ids, positions, ctx, slots = self._ids, self._positions, self._ctx, self._slots
        for i, entry in enumerate(scheduled):
            seq, table = entry.seq, entry.seq.block_table
            position = seq.num_computed_tokens
            ids[i], positions[i], ctx[i] = seq.token_ids[position], position, position + 1
            tables[i, :len(table)] = table
            slots[:, i] = self._pattern + (table[position // bs] * rows + position % bs)
        self._pad(n, size)
        self._flat.copy_(self._host, non_blocking=True)
        self.tables[:size, :widest].copy_(self._tables_host[:size * widest].view(size, widest), non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _pad(self, start: int, end: int) -> None:
        """Rows `start`..`end` of the host buffer as padded rows: throwaway tokens at position 0 in the
        scratch block (see the module docstring)."""
        self._ids[start:end], self._positions[start:end], self._ctx[start:end] = 0, 0, 1
        self._slots[:, start:end] = self._pad_slots[:, None]

    def _host_tables(self, size: int, widest: int):
        """The host's `[size, widest]` block tables (a numpy view of a buffer grown as tables widen)."""
        if self._tables_host.numel() < size * widest:
            self._tables_host = torch.empty(max(size * widest, 2 * self._tables_host.numel()), dtype=torch.long,
                                            pin_memory=self._copied is not None)
        return self._tables_host[:size * widest].numpy().reshape(size, widest)

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
