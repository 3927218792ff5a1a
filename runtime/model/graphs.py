"""The decode step a CUDA graph replays: static buffers, padded batch sizes, one capture per size.

A pure decode step (every scheduled sequence computes one new token, its block table no wider than
the buffers, no residency hooks, no recurrent layers, nothing asked of it but the logits of its
last tokens) is written into persistent device buffers (token ids, positions, KV slots, block
tables, context lengths) at the padded batch size row padding gives its sequence count
(runtime.model.row_padding), copied a step from host buffers (pinned on CUDA): one copy for all but the
tables, one for each cache's tables. The lean decoder's Triton loop (runtime.model.gpu_layers) and the
head run on them. On a CUDA device each padded size is captured once as a CUDA graph, the largest
first, all sharing one memory pool (vLLM's FULL_DECODE_ONLY), and a step replays its size's graph;
elsewhere (the CPU twin the tests run in Triton's interpreter) the same static-buffer step runs
eagerly. Any other step runs the runner's eager path, decided per step.

A model whose sliding layers keep their KV in a cache of their own (runtime.kv.window_split) has
slots and tables for that cache too (`window_table`, a released block read as its scratch block).

The padded rows are throwaway: token 0 at position 0, its key written to the scratch block and
attended from there alone. Each row of every kernel and matmul is computed from its own inputs only
(row padding is the guarantee for the matmuls), so a real row's logits are the bits the eager path
gives it, whatever the padding (tested on the CPU; `python -m bench.gpu` checks replay against eager
bit for bit on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from runtime.model.attention import AttentionMetadata, DecodeRows, WindowedLayers
from runtime.model.row_padding import RowPadding
from scheduler.scheduler import ScheduledSequence
from storage.kv_cache import KVCache

MAX_GRAPH_ROWS = 64  # the largest decode step (in sequences, before padding) a graph holds


class _CacheRows:
    """One cache's part of the static buffers: the step's KV slot rows (views of the flat buffers) and block
    tables `[largest, max_blocks]` (a host buffer copied to them a step)."""

    def __init__(self, cache: KVCache, host_slots, slot_rows: torch.Tensor, largest: int, pinned: bool) -> None:
        if cache.scratch_block is None:
            raise ValueError("a decode graph's padded rows need a scratch block in every cache")
        self.cache, self.host_slots, self.slot_rows, self.pinned = cache, host_slots, slot_rows, pinned
        # a slot's rows are its block times `block_rows`, plus its offset, plus the pattern `[2, KVH]`
        origin = torch.zeros(1, dtype=torch.long)
        self.pattern = cache.row_index(origin, origin)[:, 0].numpy()
        self.block_rows = cache.shape.num_layers * cache.layer_rows
        self.pad_slots = self.pattern + cache.scratch_block * self.block_rows  # (block `scratch`, offset 0)
        self.max_blocks = cache.num_blocks
        self.tables = torch.full((largest, self.max_blocks), cache.scratch_block, dtype=torch.long, device=cache.device)
        self._host = torch.empty(0, dtype=torch.long)

    def host_tables(self, size: int, widest: int):
        """The host's `[size, widest]` block tables, every entry the scratch block (a numpy view of a
        buffer grown as tables widen)."""
        if self._host.numel() < size * widest:
            self._host = torch.empty(max(size * widest, 2 * self._host.numel()), dtype=torch.long, pin_memory=self.pinned)
        tables = self._host[:size * widest].numpy().reshape(size, widest)
        tables.fill(self.cache.scratch_block)
        return tables

    def put(self, tables, i: int, table: list[int], position: int) -> None:
        """Row `i`: its block table and the slot of its token at `position`."""
        tables[i, :len(table)] = table
        self.host_slots[:, i] = self.pattern + (table[position // self.cache.block_size] * self.block_rows +
                                                position % self.cache.block_size)

    def pad(self, start: int, end: int) -> None:
        self.host_slots[:, start:end] = self.pad_slots[:, None]

    def copy_tables(self, size: int, widest: int) -> None:
        self.tables[:size, :widest].copy_(self._host[:size * widest].view(size, widest), non_blocking=True)

    def meta(self, size: int, rows: torch.Tensor, ctx: torch.Tensor, kernel, **more) -> AttentionMetadata:
        return AttentionMetadata(self.cache, self.slot_rows[:, :size], [], [], **more,
                                 decode_rows=DecodeRows(rows[:size], self.tables[:size], ctx[:size], kernel, widen=False))


class DecodeGraphs:
    """Static decode buffers and, on a CUDA device, one captured graph per padded batch size."""

    def __init__(self, decoder, cache: KVCache, padding: RowPadding, max_rows: int = MAX_GRAPH_ROWS,
                 capture: bool | None = None, window=None) -> None:
        """`capture`: capture graphs (default: on a CUDA device; False runs the static step eagerly);
        `window`: the sliding layers' own cache (runtime.model.model_runner.SlidingCache), or None."""
        if decoder is None or decoder.gpu is None or not padding.max_rows:
            raise ValueError("a decode graph needs the lean decoder's Triton loop and row padding")
        self.decoder, self.cache, self.window = decoder, cache, window
        self.sizes = sorted({padding.pad(n) for n in range(1, min(max_rows, padding.max_rows) + 1)})
        self.padding = padding
        self.max_rows = min(max_rows, padding.max_rows)
        self.capture = cache.device.type == "cuda" if capture is None else capture
        device, largest = cache.device, self.sizes[-1]
        caches = [cache] + ([window.cache] if window is not None else [])
        widths = [2 * largest * c.shape.num_kv_heads for c in caches]
        # Token ids, positions, context lengths and each cache's KV slot rows: views of one device buffer,
        # written a step by one copy of its host mirror (pinned on CUDA); each cache's tables another copy.
        self._host = torch.zeros(3 * largest + sum(widths), dtype=torch.long, pin_memory=self.capture)
        flat = self._flat = torch.zeros_like(self._host, device=device)
        host = self._host.numpy()
        self.input_ids, self.positions = flat[:largest].view(1, largest), flat[largest:2 * largest].view(1, largest)
        self.ctx = flat[2 * largest:3 * largest]
        self._ids, self._positions, self._ctx = host[:largest], host[largest:2 * largest], host[2 * largest:3 * largest]
        self.parts, at = [], 3 * largest
        for c, width in zip(caches, widths):
            shape = (2, largest, c.shape.num_kv_heads)
            self.parts.append(_CacheRows(c, host[at:at + width].reshape(shape), flat[at:at + width].view(shape),
                                         largest, self.capture))
            at += width
        self.slot_rows, self.tables = self.parts[0].slot_rows, self.parts[0].tables
        self._copied = torch.cuda.Event() if self.capture else None  # the last step's copies out of the host buffers
        self.rows = torch.arange(largest, device=device)
        self.logits: dict[int, torch.Tensor] = {}  # each size's output (a graph's static output on CUDA)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pad(0, largest)
        flat.copy_(self._host)
        if self.capture:
            self._capture_all()

    def covers(self, scheduled: Seq[ScheduledSequence], every_row_of: Seq) -> bool:
        """Whether this step is a pure decode step the static buffers hold."""
        wide = self.parts[-1].max_blocks if self.window is not None else None
        return 0 < len(scheduled) <= self.max_rows and not every_row_of and all(
            e.num_new_tokens == 1 and len(e.seq.block_table) <= self.parts[0].max_blocks and
            (wide is None or len(e.seq.window_table) <= wide) for e in scheduled)

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
        if self._copied is not None:
            self._copied.synchronize()  # (the host buffers' last copies are done before they are rewritten)
        main = self.parts[0]
        widest = max(len(entry.seq.block_table) for entry in scheduled)
        tables = main.host_tables(size, widest)
        if self.window is not None:
            sliding, scratch = self.parts[1], self.window.cache.scratch_block
            window_widest = max(len(entry.seq.window_table) for entry in scheduled)
            window_tables = sliding.host_tables(size, window_widest)
        ids, positions, ctx = self._ids, self._positions, self._ctx
        for i, entry in enumerate(scheduled):
            seq = entry.seq
            position = seq.num_computed_tokens
            ids[i], positions[i], ctx[i] = seq.token_ids[position], position, position + 1
            main.put(tables, i, seq.block_table, position)
            if self.window is not None:  # (a released block read as the scratch block)
                sliding.put(window_tables, i, [scratch if b is None else b for b in seq.window_table], position)
        self._pad(len(scheduled), size)
        self._flat.copy_(self._host, non_blocking=True)
        main.copy_tables(size, widest)
        if self.window is not None:
            sliding.copy_tables(size, window_widest)
        if self._copied is not None:
            self._copied.record()

    def _pad(self, start: int, end: int) -> None:
        """Rows `start`..`end` of the host buffer as padded rows: throwaway tokens at position 0 in the
        scratch block (see the module docstring)."""
        self._ids[start:end], self._positions[start:end], self._ctx[start:end] = 0, 0, 1
        for part in self.parts:
            part.pad(start, end)

    def _step(self, size: int) -> torch.Tensor:
        """The static-buffer step at padded size `size`: the lean decoder's Triton loop and the head."""
        kernel = self.decoder.gpu.attention_kernel
        window = None if self.window is None else WindowedLayers(
            self.parts[1].meta(size, self.rows, self.ctx, kernel), self.window.places, self.window.window)
        meta = self.parts[0].meta(size, self.rows, self.ctx, kernel, window=window)
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
