"""Attention over a partially resident KV cache, registered in transformers' attention registry.

Like `runtime.attention` (the runner flattens the step's new tokens into one row with their true
positions, our function writes the new keys/values into compute slots), with two differences:

- Layer-wise staging: layers from `staging.first_layer` on read each sequence's full blocks from
  a staging buffer that the layer-wise policy fills per layer (waiting there counts as stall),
  and only the block being written from the compute tier.
- Schedule independence: decoding sequences are attended in batches of equal context length,
  each key/value tensor exactly that long (no padding), so a beam's attention output is the same
  bits whichever beams share its forward pass and whichever path (resident or staged) its keys
  took.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from storage.kv_cache import KVCache

OFFLOAD_ATTENTION = "ponder_offload"
META_KWARG = "ponder_offload"


class LayerStaging(Protocol):
    first_layer: int

    def staged(self, layer: int) -> torch.Tensor:
        """`[2, kv_heads, num_beams, max_full_blocks, block_size, head_dim]` of `layer`: keys and
        values of each beam's full blocks."""


@dataclass
class DecodeBatch:
    """Sequences decoding one token each, all attending `ctx_len` tokens."""

    rows: torch.Tensor  # [n] positions in the token row
    tables: torch.Tensor  # [n, num_blocks] compute slots covering ctx_len tokens, prefix first
    ctx_len: int
    staged_index: torch.Tensor | None = None  # [n] rows of the staging buffer (staged layers)


@dataclass
class PrefillSeq:
    q_start: int
    q_len: int
    ctx_len: int
    table: torch.Tensor  # [num_blocks] compute slots


@dataclass
class OffloadMeta:
    cache: KVCache
    slot_blocks: torch.Tensor  # [T] compute slot of every new token
    slot_offsets: torch.Tensor  # [T] offset inside its block
    decode: list[DecodeBatch] = field(default_factory=list)
    prefill: list[PrefillSeq] = field(default_factory=list)
    staging: LayerStaging | None = None


def _gather(cache: KVCache, layer: int, kv: int, tables: torch.Tensor) -> torch.Tensor:
    """Keys (kv=0) or values (kv=1) of `tables` `[n, nb]` as `[H, n, nb, bs, D]`, one copy
    (`index_select` over the block axis copies whole `[bs, D]` runs, unlike advanced indexing)."""
    source = cache.kv[:, layer, kv].transpose(0, 1)  # [H, num_blocks, bs, D], a view
    picked = torch.index_select(source, 1, tables.reshape(-1))
    return picked.view(source.shape[0], *tables.shape, *source.shape[2:])


def _sequence_major(x: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """`[H, n, nb, bs, D]` -> `[n, H, ctx_len, D]` without a copy (nb and bs stay adjacent)."""
    h, n, nb, bs, d = x.shape
    return x.transpose(0, 1).reshape(n, h, nb * bs, d)[:, :, :ctx_len]


def offload_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    meta: OffloadMeta = kwargs[META_KWARG]
    layer = module.layer_idx
    cache = meta.cache
    # query [1, H, T, D]; key/value [1, KVH, T, D]
    cache.write(layer, meta.slot_blocks, meta.slot_offsets, key[0].transpose(0, 1),
                value[0].transpose(0, 1))
    staging = meta.staging
    staged = staging.staged(layer) if staging is not None and layer >= staging.first_layer else None
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, H, D]

    for batch in meta.decode:
        q = query[0, :, batch.rows].transpose(0, 1).unsqueeze(2).contiguous()  # [n, H, 1, D]
        if staged is None:
            k, v = (_gather(cache, layer, i, batch.tables) for i in (0, 1))
        else:  # full blocks from staging, the block being written from the compute tier
            num_full = batch.tables.shape[1] - 1
            k, v = (torch.cat((torch.index_select(staged[i][:, :, :num_full], 1, batch.staged_index),
                               _gather(cache, layer, i, batch.tables[:, num_full:])), dim=2)
                    for i in (0, 1))
        k, v = _sequence_major(k, batch.ctx_len), _sequence_major(v, batch.ctx_len)
        o = F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=True)
        out[batch.rows] = o[:, :, 0]

    for p in meta.prefill:
        q = query[:, :, p.q_start:p.q_start + p.q_len]
        k, v = (_sequence_major(_gather(cache, layer, i, p.table[None]), p.ctx_len) for i in (0, 1))
        # Query i (absolute position ctx_len - q_len + i) sees keys up to its own position.
        rows = torch.arange(p.ctx_len - p.q_len, p.ctx_len, device=query.device)[:, None]
        mask = torch.arange(p.ctx_len, device=query.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        out[p.q_start:p.q_start + p.q_len] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    return None


def register() -> str:
    AttentionInterface.register(OFFLOAD_ATTENTION, offload_attention)
    AttentionMaskInterface.register(OFFLOAD_ATTENTION, _no_mask)
    return OFFLOAD_ATTENTION
