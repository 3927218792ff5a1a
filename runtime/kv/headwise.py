"""Head-wise KV offloading of one sequence (after HeadInfer): the compute tier holds a budget of
(block, layer, KV-head group) pieces, the host and disk tiers hold the rest, and decoding stays
exact.

Per forward, per layer, per KV-head group (a slice): the slice's pieces are loaded into a staging
buffer (the next slice's load runs while this one computes), the query heads of that group attend
the slice's whole context, and the new full blocks are written back (or kept, if resident). The
prompt is prefilled in chunks through the same path, so the whole KV is never in compute at once.
`head_pieces` says which pieces stay resident and how the budget is spent.

Exactness: each head attends its full context with one softmax, through SDPA's math backend,
whose per-head result does not depend on which heads share the call (the fused CPU and CUDA
kernels split work by head count, which changes the last bits). So the logits do not depend on the
budget, the group size or the tiers, and greedy tokens match transformers' `generate`.

A piece that is missing or fails its disk checksum raises `PieceLost` before anything reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from runtime.model import attention
from runtime.kv.head_pieces import HeadwiseStore, PiecePlan
from storage.piece_transfers import PiecePipeline
from storage.tiers import TierChain

HEADWISE_ATTENTION = "ponder_headwise"
META_KWARG = "ponder_headwise"


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """`[1, H, T, D]` queries over `[1, KVH, ctx, D]` keys/values; every head's math is the same
    whichever heads share the call."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                              enable_gqa=True)


@dataclass
class _Forward:
    store: HeadwiseStore
    start: int
    end: int
    mask: torch.Tensor | None  # [T, end] for a chunk, None for one token


def headwise_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       **kwargs):
    fwd: _Forward = kwargs[META_KWARG]
    store, start, end = fwd.store, fwd.start, fwd.end
    plan = store.plan
    gh = plan.group_heads
    rep = query.shape[1] // key.shape[1]  # query heads per KV head
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, H, D]
    for group in range(plan.num_groups):
        s = module.layer_idx * plan.num_groups + group
        kv_heads = slice(group * gh, (group + 1) * gh)
        q_heads = slice(group * gh * rep, (group + 1) * gh * rep)
        buf = store.acquire(s)
        buf[0, :, start:end] = key[0, kv_heads]
        buf[1, :, start:end] = value[0, kv_heads]
        o = attend(query[:, q_heads], buf[None, 0, :, :end], buf[None, 1, :, :end], fwd.mask,
                   scaling)
        out[:, q_heads] = o[0].transpose(0, 1)
        store.release(s, end)
    return out.unsqueeze(0), None


def register() -> str:
    return attention.register(HEADWISE_ATTENTION, headwise_attention)


class HeadwiseDecoder:
    """One sequence of up to `plan.max_tokens` tokens over a head-wise tiered KV: its compute-tier
    tensors carved from `arena`, the rest in `chain`. Each forward switches the model's attention
    to the head-wise one and back."""

    def __init__(self, model, plan: PiecePlan, chain: TierChain, arena: torch.Tensor,
                 extra_key: bytes) -> None:
        self.model = model
        self.plan = plan
        self.chain = chain
        self.device = arena.device
        self.pipeline = PiecePipeline(chain, self.device)
        self.store = HeadwiseStore(plan, arena, self.pipeline, extra_key)
        self.loads_per_forward: list[int] = []
        self.num_tokens = 0

    def close(self) -> None:
        self.pipeline.close()

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Append `token_ids` (one token, or a prefill chunk); float32 logits of the last."""
        start, end = self.num_tokens, self.num_tokens + len(token_ids)
        self.store.begin(list(token_ids), start)
        mask = None
        if len(token_ids) > 1:  # query i (position start + i) sees keys up to its own position
            rows = torch.arange(start, end, device=self.device)[:, None]
            mask = torch.arange(end, device=self.device)[None, :] <= rows
        self.loads_per_forward.append(self.plan.loads(start))
        loaded = self.store.num_loaded
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(register())
        try:
            out = self.model(input_ids=torch.tensor([list(token_ids)], device=self.device),
                             position_ids=torch.arange(start, end, device=self.device)[None],
                             use_cache=False, logits_to_keep=1,
                             **{META_KWARG: _Forward(self.store, start, end, mask)})
        finally:
            self.model.set_attn_implementation(previous)
        assert self.store.num_loaded - loaded == self.loads_per_forward[-1], "loads off plan"
        self.num_tokens = end
        return out.logits[0, -1].float()
