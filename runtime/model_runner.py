"""Runs one scheduled step through a transformers model over the paged KV cache.

The runner never decides what runs: it turns the scheduler's plan into tensors, performs the
copies it asks for, runs the model once and returns the logits the plan needs.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from runtime.attention import AttentionMetadata, PrefillSlice
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
    def __init__(self, model, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.block_size

    @torch.inference_mode()
    def execute(self, scheduled: Seq[ScheduledSequence], copies: Seq[tuple[int, int]],
                logits_for: Seq[int]) -> torch.Tensor:
        """Compute the scheduled tokens; return float32 logits `[len(logits_for), vocab]` at the last
        new token of each scheduled entry whose index is in `logits_for`."""
        step = self._prepare(scheduled, copies)
        keep = torch.tensor([step.last_token_index[i] for i in logits_for] or [step.num_tokens - 1],
                            device=self.device, dtype=torch.long)
        out = self.model(input_ids=step.input_ids, position_ids=step.positions, use_cache=False,
                         logits_to_keep=keep, ponder_attention=step.meta)
        logits = out.logits[0]
        return logits.float() if logits_for else logits[:0].float()

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
        decode_index: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
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
            if entry.num_new_tokens == 1 and start > 0:
                decode_index.append(q_start)
                decode_tables.append(table[: -(-end // bs)])
                decode_lens.append(end)
            else:
                prefills.append(self._prefill_slice(q_start, start, end, table))

        meta = AttentionMetadata(
            cache=self.cache,
            slot_blocks=torch.tensor(slot_blocks, device=self.device),
            slot_offsets=torch.tensor(slot_offsets, device=self.device),
            decode_index=None, decode_tables=None, decode_mask=None,
            prefills=prefills,
        )
        if decode_index:
            width = max(len(t) for t in decode_tables)
            tables = torch.tensor([t + [t[-1]] * (width - len(t)) for t in decode_tables], device=self.device)
            lens = torch.tensor(decode_lens, device=self.device)
            mask = torch.arange(width * bs, device=self.device)[None, :] < lens[:, None]
            meta.decode_index = torch.tensor(decode_index, device=self.device)
            meta.decode_tables = tables
            meta.decode_mask = mask[:, None, None, :]
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
