"""Runs one forward pass of the offloaded executor: a prompt prefill, or one decode token for each
of a set of beams, over compute-tier slots chosen by the caller.

The runner never decides what runs or where blocks live: it turns slots into tensors, calls the
model with the offload attention and returns float32 logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.offload.attention import META_KWARG, DecodeBatch, LayerStaging, OffloadMeta, PrefillSeq
from storage.kv_cache import KVCache


@dataclass(frozen=True)
class DecodeEntry:
    """One beam's next token: it sits at `position` and attends `position + 1` tokens, whose
    blocks are the compute slots `table` (prefix first)."""

    token_id: int
    position: int
    table: tuple[int, ...]
    staged_index: int | None = None  # the beam's row in a layer-wise staging buffer


class OffloadRunner:
    def __init__(self, model) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.num_forwards = 0

    @torch.inference_mode()
    def prefill(self, cache: KVCache, token_ids: Sequence[int], table: Sequence[int]) -> torch.Tensor:
        """KV of every token of a fresh sequence into `table`; logits `[vocab]` of its last token."""
        bs = cache.block_size
        n = len(token_ids)
        meta = OffloadMeta(
            cache=cache,
            slot_blocks=torch.tensor([table[p // bs] for p in range(n)], device=self.device),
            slot_offsets=torch.tensor([p % bs for p in range(n)], device=self.device),
            prefill=[PrefillSeq(0, n, n, torch.tensor(list(table[:-(-n // bs)]), device=self.device))])
        logits = self._forward(list(token_ids), list(range(n)), meta, keep=1)
        return logits[-1]

    @torch.inference_mode()
    def decode(self, cache: KVCache, entries: Sequence[DecodeEntry],
               staging: LayerStaging | None = None) -> torch.Tensor:
        """One token for each entry; logits `[len(entries), vocab]` in entry order."""
        bs = cache.block_size
        by_ctx: dict[int, list[int]] = {}
        for row, e in enumerate(entries):
            if len(e.table) != -(-(e.position + 1) // bs):
                raise ValueError(f"a table of {len(e.table)} blocks for {e.position + 1} tokens")
            by_ctx.setdefault(e.position + 1, []).append(row)
        batches = []
        for ctx_len, rows in by_ctx.items():
            staged = None
            if staging is not None:
                staged = torch.tensor([entries[r].staged_index for r in rows], device=self.device)
            batches.append(DecodeBatch(
                rows=torch.tensor(rows, device=self.device),
                tables=torch.tensor([entries[r].table for r in rows], device=self.device),
                ctx_len=ctx_len, staged_index=staged))
        meta = OffloadMeta(
            cache=cache,
            slot_blocks=torch.tensor([e.table[e.position // bs] for e in entries], device=self.device),
            slot_offsets=torch.tensor([e.position % bs for e in entries], device=self.device),
            decode=batches, staging=staging)
        return self._forward([e.token_id for e in entries], [e.position for e in entries], meta,
                             keep=0)

    def _forward(self, input_ids: list[int], positions: list[int], meta: OffloadMeta,
                 keep: int) -> torch.Tensor:
        self.num_forwards += 1
        out = self.model(
            input_ids=torch.tensor([input_ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            use_cache=False,
            logits_to_keep=keep,  # 0 keeps every row
            **{META_KWARG: meta},
        )
        return out.logits[0].float()
