"""Runs one scheduled step through a transformers model over the paged KV cache.

The runner never decides what runs: it turns the scheduler's plan into tensors, performs the
copies it asks for, runs the model once and returns the logits the plan needs.

With a `RowPadding` (and a cache with a scratch block), a step's tokens are padded with throwaway
tokens, and the head's rows with repeats, up to a row count for which every row's bits do not
depend on the others (see runtime.row_padding): results never depend on what shares the step.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from runtime.attention import AttentionMetadata, DecodeGroup, PrefillSlice
from runtime.row_padding import RowPadding
from scheduler.scheduler import ScheduledSequence
from storage.kv_cache import KVCache


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
    def __init__(self, model, cache: KVCache, padding: RowPadding | None = None) -> None:
        if padding is not None and cache.scratch_block is None:
            raise ValueError("padding a step needs a cache with a scratch block")
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.block_size
        self.padding = padding or RowPadding.none()

    def padded_rows(self, rows: list[int]) -> list[int]:
        """`rows` with the last repeated up to a row count that keeps each row's bits its own."""
        return rows + rows[-1:] * (self.padding.pad(len(rows)) - len(rows)) if rows else rows

    @torch.inference_mode()
    def execute(self, scheduled: Seq[ScheduledSequence], copies: Seq[tuple[int, int]],
                logits_for: Seq[int]) -> torch.Tensor:
        """Compute the scheduled tokens; return float32 logits `[len(logits_for), vocab]` at the last
        new token of each scheduled entry whose index is in `logits_for`."""
        step = self._prepare(scheduled, copies)
        rows = self.padded_rows([step.last_token_index[i] for i in logits_for] or [step.num_tokens - 1])
        keep = torch.tensor(rows, device=self.device, dtype=torch.long)
        out = self.model(input_ids=step.input_ids, position_ids=step.positions, use_cache=False,
                         logits_to_keep=keep, ponder_attention=step.meta)
        logits = out.logits[0]
        return logits[:len(logits_for)].float()

    @torch.inference_mode()
    def hidden_states(self, scheduled: Seq[ScheduledSequence], copies: Seq[tuple[int, int]],
                      reads: Seq[tuple[int, int]]) -> torch.Tensor:
        """Compute the scheduled tokens with the base model (no head); return the final hidden states
        `[len(reads), hidden]` at (entry index, absolute token position) pairs, which must be new tokens."""
        step = self._prepare(scheduled, copies)
        rows = []
        for index, position in reads:
            entry = scheduled[index]
            offset = position - entry.seq.num_computed_tokens
            assert 0 <= offset < entry.num_new_tokens, "a read position must be computed in this step"
            rows.append(step.entry_start[index] + offset)
        out = self.model.base_model(input_ids=step.input_ids, position_ids=step.positions, use_cache=False,
                                    ponder_attention=step.meta)
        return out.last_hidden_state[0, torch.tensor(rows, device=self.device, dtype=torch.long)]

    def _prepare(self, scheduled: Seq[ScheduledSequence], copies: Seq[tuple[int, int]]) -> "StepInputs":
        self.cache.copy_blocks(list(copies))
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        decode: dict[int, tuple[list[int], list[list[int]]]] = {}  # context length -> (rows, tables)
        prefills: list[PrefillSlice] = []
        last_token_index: list[int] = []
        entry_start: list[int] = []

        bs = self.block_size
        for entry in scheduled:
            seq = entry.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + entry.num_new_tokens
            q_start = len(input_ids)
            entry_start.append(q_start)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            for pos in range(start, end):
                slot_blocks.append(table[pos // bs])
                slot_offsets.append(pos % bs)
            last_token_index.append(len(input_ids) - 1)
            # Prompt tokens are prefilled; generated ones (new, or recomputed) attend one query at a time.
            split = min(max(start, seq.num_prompt_tokens), end)
            if split > start:
                prefills.append(self._prefill_slice(q_start, start, split, table))
            for pos in range(split, end):
                rows, tables = decode.setdefault(pos + 1, ([], []))
                rows.append(q_start + pos - start)
                tables.append(table[: pos // bs + 1])
        num_pad = self.padding.pad(len(input_ids)) - len(input_ids)
        if num_pad:  # throwaway tokens: keys written to the scratch block, attention output zero
            input_ids.extend([0] * num_pad)
            positions.extend(range(num_pad))
            slot_blocks.extend([self.cache.scratch_block] * num_pad)
            slot_offsets.extend(i % bs for i in range(num_pad))

        meta = AttentionMetadata(
            cache=self.cache,
            slot_blocks=torch.tensor(slot_blocks, device=self.device),
            slot_offsets=torch.tensor(slot_offsets, device=self.device),
            decode_groups=[DecodeGroup(torch.tensor(rows, device=self.device),
                                       torch.tensor(tables, device=self.device), ctx_len)
                           for ctx_len, (rows, tables) in sorted(decode.items())],
            prefills=prefills,
            num_padding=num_pad,
        )
        return StepInputs(torch.tensor([input_ids], device=self.device), torch.tensor([positions], device=self.device),
                          meta, last_token_index, entry_start)

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
