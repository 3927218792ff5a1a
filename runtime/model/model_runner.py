"""Runs one scheduled step through a transformers model over the paged KV cache.

The runner never decides what runs: it turns the scheduler's plan into tensors, performs the
copies it asks for, runs the model once and returns the logits the plan needs.

With a `RowPadding` (and a cache with a scratch block), a step's tokens are padded with throwaway
tokens, and the head's rows with repeats, up to a row count for which every row's bits do not
depend on the others (see runtime.model.row_padding): results never depend on what shares the step.
Prompt tokens then attend like generated ones too, one query at a time against the paged KV
(runtime.model.attention), so a token's bits do not depend on how its prompt was chunked or how much of
it came from the prefix cache either.

A residency holding a step's KV itself (head-wise, runtime.kv.headwise) says so first
(`StepResidency.attention`): the step's one sequence holds no block, goes unpadded, and it attends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from runtime.model.attention import (AttentionMetadata, DecodeGroup, DecodeRows, LayerHooks, PrefillSlice, WindowedLayers,
                                     bucket_blocks)
from runtime.kernels.cpu_kernels import KERNEL_CACHE_DTYPES, KernelUnavailable, attention_kernel
from runtime.kernels.gpu import attends as gpu_attends
from runtime.model.decode_step import PlainDecode, plain_decode
from runtime.model.decoders import build_decoder
from runtime.model.recurrent import RecurrentLayers, RecurrentStep, Segment
from runtime.model.row_padding import ATTENTION_BATCH, RowPadding
from scheduler.scheduler import ScheduledSequence
from storage.kv_cache import KVCache
from storage.recurrent_state import RecurrentStates

GATHER_TOKENS = 1 << 16  # keys one attention group may gather (queries x window)


def _attention_kernel(cache: KVCache):
    """ponder's decode attention kernel where it can read this cache (float32 or bfloat16, on the CPU), else None."""
    if cache.device.type != "cpu" or cache.dtype not in KERNEL_CACHE_DTYPES or cache.shape.head_dim % 8:
        return None
    try:
        return attention_kernel()
    except KernelUnavailable:
        return None


class StepResidency(LayerHooks, Protocol):
    """What the runner asks of where the KV lives below compute (runtime.kv.residency.Residency)."""

    def attention(self, scheduled: Seq[ScheduledSequence]) -> Callable[..., torch.Tensor] | None:
        """Asked first: its own attention of every layer when it holds the step's KV itself, else None."""
        ...

    def begin_step(self, scheduled: Seq[ScheduledSequence], copies: Seq[tuple[int, int]]) -> bool:
        """Called with a step's plan after its copies: settle the blocks it reads, and say whether
        its layers need `before_layer` and `after_layer`."""
        ...

    def end_step(self) -> None:
        """The step's forward is over (or raised): forget its per-step state."""
        ...


@dataclass(frozen=True)
class SlidingCache:
    """The sliding layers' own cache (runtime.kv.window_split): `places[layer]` = (whether the layer slides,
    its index in its group's cache); blocks before a sequence's `window` are released (scheduler.sliding_window)."""

    cache: KVCache
    places: tuple[tuple[bool, int], ...]
    window: int


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]
    meta: AttentionMetadata
    last_token_index: list[int]  # row of each entry's last new token
    entry_start: list[int]  # row of each entry's first new token

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


class ModelRunner:
    def __init__(self, model, cache: KVCache, padding: RowPadding | None = None,
                 states: RecurrentStates | None = None, gpu_kernels: bool | None = None,
                 window: SlidingCache | None = None) -> None:
        """`gpu_kernels`: decode steps in ponder's Triton kernels (runtime.model.gpu_layers); None: on a CUDA
        device where Triton imports. `window`: the sliding layers' KV kept apart, in its own cache (`cache`
        then holds the other layers'), read through each sequence's `window_table`."""
        if padding is not None and cache.scratch_block is None:
            raise ValueError("padding a step needs a cache with a scratch block")
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.block_size
        self.padding = padding or RowPadding.none()
        self.window = window
        self.residency: StepResidency | None = None  # None: every layer of every block is resident
        self.exact_prefill = padding is not None  # prompt tokens attend as generated ones do
        # transformers' arithmetic with fewer operators where the architecture is known (runtime.model.decoder)
        self.decoder = build_decoder(model)
        self.attention_kernel = _attention_kernel(cache)
        self.gpu_kernels = False  # decode attention (and the lean decoder's decode steps) in Triton
        self.graphs = None  # runtime.model.graphs.DecodeGraphs: pure decode steps from static buffers (`use_graphs`)
        if gpu_kernels or (gpu_kernels is None and gpu_attends(cache.device, cache.block_size)):
            self.use_gpu_kernels()
        # Linear-attention layers (runtime.model.recurrent): each sequence's state beside its blocks
        self.recurrent = RecurrentLayers.build(model, states)

    def use_gpu_kernels(self) -> None:
        """Attend generated tokens with the Triton decode kernel, and run the lean decoder's decode steps in
        its Triton loop (on a CPU only in Triton's interpreter, as the tests do)."""
        from runtime.kernels.gpu.paged import decode_attention

        if self.block_size & (self.block_size - 1):
            raise ValueError(f"the Triton decode kernel reads a block as one tile: block_size {self.block_size} "
                             "is not a power of two")
        self.attention_kernel = decode_attention
        self.gpu_kernels = True
        if self.decoder is not None:
            self.decoder.use_gpu_layers()

    def use_graphs(self, capture: bool | None = None, max_rows: int | None = None) -> bool:
        """Run pure decode steps from static buffers, replaying a CUDA graph per padded batch size on a CUDA device
        (`capture` False: run eagerly, the CPU twin); False without the Triton loop, row padding or with recurrent layers."""
        from runtime.model.graphs import MAX_GRAPH_ROWS, DecodeGraphs

        if not self.gpu_kernels or self.decoder is None or self.decoder.gpu is None or not self.padding.max_rows \
                or self.recurrent is not None:
            return False
        self.graphs = DecodeGraphs(self.decoder, self.cache, self.padding, max_rows or MAX_GRAPH_ROWS, capture, self.window)
        return True

    def use_residency(self, residency: StepResidency | None) -> None:
        """Run every step from the next one on through `residency`'s hooks."""
        self.residency = residency

    def padded_rows(self, rows: list[int]) -> list[int]:
        """`rows` with the last repeated up to a row count that keeps each row's bits its own."""
        return rows + rows[-1:] * (self.padding.pad(len(rows)) - len(rows)) if rows else rows

    @torch.inference_mode()
    def execute(self, scheduled: Seq[ScheduledSequence], copies: Seq[tuple[int, int]],
                logits_for: Seq[int], every_row_of: Seq[tuple[int, int]] = (),
                window_copies: Seq[tuple[int, int]] = ()) -> torch.Tensor:
        """Compute the scheduled tokens; return float32 logits `[len(logits_for), vocab]` at the last
        new token of each scheduled entry whose index is in `logits_for`. Each (entry index, count) of
        `every_row_of` (prompt logprobs) appends the logits of that entry's first `count` new tokens;
        `window_copies`: the copies in the sliding layers' cache (`window`)."""
        if self.graphs is not None and self.residency is None and self.graphs.covers(scheduled, every_row_of):
            self._copy(copies, window_copies)
            logits = self.graphs.run(scheduled)
            return logits[torch.tensor(list(logits_for), dtype=torch.long, device=self.device)].float()
        try:
            step = self._prepare(scheduled, copies, window_copies)
            wanted = [step.last_token_index[i] for i in logits_for]
            for index, count in every_row_of:
                wanted.extend(range(step.entry_start[index], step.entry_start[index] + count))
            rows = self.padded_rows(wanted or [step.num_tokens - 1])
            keep = torch.tensor(rows, device=self.device, dtype=torch.long)
            if self.decoder is not None:
                logits = self.decoder.logits(step.input_ids, step.positions, step.meta, keep)
            else:
                logits = self.model(input_ids=step.input_ids, position_ids=step.positions, use_cache=False,
                                    logits_to_keep=keep, ponder_attention=step.meta).logits[0]
            self._finish_recurrent(step)
        finally:
            self._end_step()
        return logits[:len(wanted)].float()

    @torch.inference_mode()
    def hidden_states(self, scheduled: Seq[ScheduledSequence], copies: Seq[tuple[int, int]],
                      reads: Seq[tuple[int, int]]) -> torch.Tensor:
        """Compute the scheduled tokens with the base model (no head); return the final hidden states
        `[len(reads), hidden]` at (entry index, absolute token position) pairs, which must be new tokens."""
        try:
            step = self._prepare(scheduled, copies)
            rows = []
            for index, position in reads:
                entry = scheduled[index]
                offset = position - entry.seq.num_computed_tokens
                assert 0 <= offset < entry.num_new_tokens, "a read position must be computed in this step"
                rows.append(step.entry_start[index] + offset)
            if self.decoder is not None:
                hidden = self.decoder.hidden_states(step.input_ids, step.positions, step.meta)
            else:
                hidden = self.model.base_model(input_ids=step.input_ids, position_ids=step.positions,
                                               use_cache=False, ponder_attention=step.meta).last_hidden_state[0]
            self._finish_recurrent(step)
        finally:
            self._end_step()
        return hidden[torch.tensor(rows, device=self.device, dtype=torch.long)]

    def _finish_recurrent(self, step: "StepInputs") -> None:
        if step.meta.recurrent is not None:
            self.recurrent.finish(step.meta.recurrent)

    def _end_step(self) -> None:
        if self.residency is not None:
            self.residency.end_step()

    def _copy(self, copies: Seq[tuple[int, int]], window_copies: Seq[tuple[int, int]]) -> None:  # (copy on write)
        self.cache.copy_blocks(list(copies))
        if self.window is not None:
            self.window.cache.copy_blocks(list(window_copies))

    def _prepare(self, scheduled: Seq[ScheduledSequence], copies: Seq[tuple[int, int]],
                 window_copies: Seq[tuple[int, int]] = ()) -> "StepInputs":
        """The step's tensors, built with O(entries) Python and a fixed number of tensor operations."""
        self._copy(copies, window_copies)
        attention = self.residency.attention(scheduled) if self.residency is not None else None
        if attention is not None:  # one sequence's tokens and positions, unpadded: the residency attends
            if self.recurrent is not None:
                raise RuntimeError("a model with recurrent layers runs over the paged KV only (not head-wise)")
            (entry,) = scheduled
            start, end = entry.seq.num_computed_tokens, entry.seq.num_computed_tokens + entry.num_new_tokens
            meta = AttentionMetadata(self.cache, torch.empty(0), [], [], attention=attention)
            return StepInputs(torch.tensor([entry.seq.token_ids[start:end]], device=self.device),
                              torch.arange(start, end, device=self.device)[None], meta, [end - start - 1], [0])
        plain = None if self.recurrent is not None or self.window is not None or self.attention_kernel is None \
            else plain_decode(scheduled, self.block_size, self.exact_prefill)
        if plain is not None and self.padding.pad(len(plain.positions)) == len(plain.positions):
            return self._plain_inputs(plain, scheduled, copies)
        bs = self.block_size
        input_ids: list[int] = []
        tables: list[int] = []  # every entry's block table, one after another
        window_tables: list[int] = []  # and window table, a released block read as the scratch block
        window_prefills: list[PrefillSlice] = []
        starts, counts, splits, table_starts = [], [], [], []
        new_starts: list[int] = []  # each entry's first new token (after the recomputed ones)
        prefills: list[PrefillSlice] = []
        entry_start: list[int] = []
        segments: list[Segment] = []
        entry_rows: list[int] = []  # each entry's first row (of its first recomputed token, where any)
        for entry in scheduled:
            seq = entry.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + entry.num_new_tokens
            # A model with recurrent layers recomputes, from the state it resumes, the tokens its state
            # lacks: they read the KV they have and write theirs nowhere (the scratch block).
            begin = start
            if self.recurrent is not None:
                resume = self.recurrent.resume(seq.seq_id, seq.token_ids, start)
                begin = resume.num_tokens
                segments.append(Segment(seq.seq_id, seq.token_ids, len(input_ids), begin, end, resume))
            entry_rows.append(len(input_ids))
            input_ids.extend(seq.token_ids[begin:end])
            entry_start.append(len(input_ids) - (end - start))
            # Prompt tokens are prefilled; generated ones (new, or recomputed) attend one query at a time,
            # and so do prompt tokens when results must not depend on the schedule.
            split = start if self.exact_prefill else min(max(start, seq.num_prompt_tokens), end)
            window_table = [] if self.window is None else \
                [self.window.cache.scratch_block if b is None else b for b in seq.window_table]
            if split > start:
                prefills.append(self._prefill_slice(entry_start[-1], start, split, seq.block_table))
                if self.window is not None:
                    window_prefills.append(self._prefill_slice(entry_start[-1], start, split, window_table))
            starts.append(begin)
            counts.append(end - begin)
            splits.append(split)
            new_starts.append(start)
            table_starts.append(len(tables))
            tables.extend(seq.block_table)
            window_tables.extend(window_table)
        num_tokens = len(input_ids)
        last_token_index = [s + c - 1 for s, c in zip(entry_rows, counts)]
        num_pad = self.padding.pad(num_tokens) - num_tokens

        # Per token: its entry, absolute position, and slot (block, offset).
        count_t = torch.tensor(counts)
        entry_of = torch.repeat_interleave(torch.arange(len(counts)), count_t)
        first_row = torch.tensor(entry_rows)[entry_of]
        positions = torch.tensor(starts)[entry_of] + torch.arange(num_tokens) - first_row
        table_start_t = torch.tensor(table_starts, dtype=torch.long)
        # The generated tokens (and, with exact prefill, every token; and the tokens a recurrent state
        # is recomputed over): they attend one query at a time.
        attends_alone = positions >= torch.tensor(splits)[entry_of]
        recomputed = None
        if segments:  # only a model with recurrent layers recomputes tokens before the new ones
            recomputed = positions < torch.tensor(new_starts)[entry_of]
            attends_alone |= recomputed
        generated = torch.nonzero(attends_alone).flatten()
        reads = (table_start_t, positions, entry_of, generated, recomputed, num_pad)

        to = self.device
        residency = self.residency
        layers = residency if residency is not None and residency.begin_step(scheduled, copies) else None
        window = None if self.window is None else WindowedLayers(
            self._cache_meta(self.window.cache, window_tables, window_prefills, *reads), self.window.places,
            self.window.window)
        meta = self._cache_meta(self.cache, tables, prefills, *reads, layers=layers, window=window,
                                recurrent=RecurrentStep(segments, bs) if segments else None)
        if num_pad:  # throwaway tokens: keys written to the scratch block, attention output zero
            input_ids.extend([0] * num_pad)
            positions = torch.cat([positions, torch.arange(num_pad)])
        return StepInputs(torch.tensor([input_ids], device=to), positions[None].to(to), meta, last_token_index,
                          entry_start)

    def _plain_inputs(self, plain: PlainDecode, scheduled: Seq[ScheduledSequence],
                      copies: Seq[tuple[int, int]]) -> "StepInputs":
        """The step `_prepare` builds for a plain decode step (runtime.model.decode_step), from its lists."""
        to, n, residency = self.device, len(plain.positions), self.residency
        layers = residency if residency is not None and residency.begin_step(scheduled, copies) else None
        slot_rows = self.cache.row_index(torch.tensor(plain.slot_blocks), torch.tensor(plain.slot_offsets))
        rows = DecodeRows(torch.arange(n).to(to), torch.tensor(plain.tables).to(to), torch.tensor(plain.ctx).to(to),
                          self.attention_kernel, widen=not self.gpu_kernels)
        meta = AttentionMetadata(cache=self.cache, slot_rows=slot_rows.to(to), decode_groups=[], prefills=[],
                                 decode_rows=rows, layers=layers)
        return StepInputs(torch.tensor([plain.token_ids], device=to), torch.tensor([plain.positions], device=to), meta,
                          list(range(n)), list(range(n)))

    def _cache_meta(self, cache: KVCache, tables: list[int], prefills: list[PrefillSlice], table_starts: torch.Tensor,
                    positions: torch.Tensor, entry_of: torch.Tensor, generated: torch.Tensor,
                    recomputed: torch.Tensor | None, num_pad: int, **fields) -> AttentionMetadata:
        """The step's slots and reads in `cache` through the entries' `tables` (one after another): the
        sliding layers' cache, where kept apart, has its own (`window`)."""
        bs = self.block_size
        table_t = torch.tensor(tables, dtype=torch.long)
        slot_blocks = table_t[table_starts[entry_of] + positions // bs]
        slot_offsets = positions % bs
        if recomputed is not None:  # a recurrent state's recomputed tokens write their KV nowhere
            slot_blocks = slot_blocks.masked_fill(recomputed, cache.scratch_block)
        decode_rows, decode_groups = None, []
        if self.attention_kernel is not None:
            decode_rows = self._decode_rows(generated, positions, entry_of, table_t, table_starts)
        else:
            decode_groups = self._decode_groups(generated, positions, entry_of, table_t, table_starts, cache)
        if num_pad:  # throwaway tokens: keys written to the scratch block
            pad_positions = torch.arange(num_pad)
            slot_blocks = torch.cat([slot_blocks, torch.full((num_pad,), cache.scratch_block)])
            slot_offsets = torch.cat([slot_offsets, pad_positions % bs])
        slot_rows = cache.row_index(slot_blocks, slot_offsets)
        decode_only = not prefills and not num_pad and len(decode_groups) == 1 and \
            decode_groups[0].rows.shape[0] == positions.shape[0]
        return AttentionMetadata(cache=cache, slot_rows=slot_rows.to(self.device), decode_groups=decode_groups,
                                 prefills=prefills, num_padding=num_pad, decode_only=decode_only,
                                 decode_rows=decode_rows, **fields)

    def _decode_rows(self, rows: torch.Tensor, positions: torch.Tensor, entry_of: torch.Tensor,
                     tables: torch.Tensor, table_starts: torch.Tensor) -> DecodeRows | None:
        """The tokens at `rows` with their block tables and context lengths, for the CPU kernel."""
        if not len(rows):
            return None
        ctx = positions[rows] + 1
        width = -(-int(ctx.max()) // self.block_size)
        index = table_starts[entry_of[rows]][:, None] + torch.arange(width)[None, :]
        to = self.device
        return DecodeRows(rows.to(to), tables[index.clamp(max=len(tables) - 1)].to(to), ctx.to(to), self.attention_kernel,
                          widen=not self.gpu_kernels)

    def _decode_groups(self, rows: torch.Tensor, positions: torch.Tensor, entry_of: torch.Tensor,
                       tables: torch.Tensor, table_starts: torch.Tensor, cache: KVCache | None = None) -> list[DecodeGroup]:
        """The tokens at `rows` grouped by window width (runtime.model.attention.bucket_blocks of their own
        context length), each with its window of block ids and the mask of the positions past its context."""
        if not len(rows):
            return []
        bs = self.block_size
        ctx = positions[rows] + 1
        entries = entry_of[rows]
        needed = (ctx + bs - 1) // bs
        windows = needed.tolist()
        widths = {n: bucket_blocks(n) for n in set(windows)}
        window_t = torch.tensor([widths[n] for n in windows])
        groups = []
        for width in sorted(set(widths.values())):
            # At most ATTENTION_BATCH queries a group (the batch counts the invariance probe checked),
            # and a bounded number of gathered keys (a long prompt's queries would copy its KV each).
            most = max(1, min(ATTENTION_BATCH, GATHER_TOKENS // (width * bs)))
            for sel in torch.nonzero(window_t == width).flatten().split(most):
                groups.append(self._decode_group(self.cache if cache is None else cache, sel, rows, ctx, entries, tables, table_starts, width))
        return groups

    def _decode_group(self, cache: KVCache, sel: torch.Tensor, rows: torch.Tensor, ctx: torch.Tensor, entries: torch.Tensor,
                      tables: torch.Tensor, table_starts: torch.Tensor, width: int) -> DecodeGroup:
        bs = self.block_size
        position = torch.arange(width * bs)[None, :]
        masked = position >= ctx[sel][:, None]  # [G, width]
        # Positions past a query's context read its position 0: finite, and weighted exactly 0.
        position = position.masked_fill(masked, 0)
        blocks = tables[table_starts[entries[sel]][:, None] + position // bs]
        kv_rows = cache.row_index(blocks, position % bs).transpose(2, 3).contiguous()  # [2, G, KVH, width]
        return DecodeGroup(rows[sel].to(self.device), kv_rows.to(self.device),
                           masked[:, None, None, :].to(self.device), width * bs)

    def _prefill_slice(self, q_start: int, start: int, end: int, table: list[int]) -> PrefillSlice:
        q_len = end - start
        if start == 0:
            return PrefillSlice(q_start, q_len, end, torch.empty(0), None)
        num_blocks = -(-end // self.block_size)
        block_table = torch.tensor([table[:num_blocks]], device=self.device)
        # Query i (absolute position start+i) sees keys 0..start+i.
        rows = torch.arange(start, end, device=self.device)[:, None]
        cols = torch.arange(end, device=self.device)[None, :]
        return PrefillSlice(q_start, q_len, end, block_table, cols <= rows)
