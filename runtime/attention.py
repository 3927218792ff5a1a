"""Paged attention plugged into transformers' attention-function registry.

The runner flattens every scheduled sequence's new tokens into one row (batch 1, T tokens) with
their true position ids, so any decoder-only transformers model computes its projections and
rotary embeddings unchanged. Our attention function then writes the new keys/values into their
paged slots and attends each sequence's queries to its own blocks.

Generated tokens (decoded, or recomputed after their blocks were given up) are attended one query
at a time over exactly their context, in batches of equal context length, with plain matmuls and
a softmax: a query's result is then the same bits whatever else is in the batch, and a token
recomputed later gets the KV it had when it was decoded. Prompts are prefilled with SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from storage.kv_cache import KVCache

ATTENTION_NAME = "ponder_paged"


@dataclass
class PrefillSlice:
    """A sequence computing `q_len` new tokens on top of `ctx_len - q_len` tokens already cached."""

    q_start: int
    q_len: int
    ctx_len: int
    block_table: torch.Tensor  # [1, num_blocks]
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, None when nothing was cached (plain causal)


@dataclass
class DecodeGroup:
    """Queries that each attend to exactly `ctx_len` tokens of their own blocks."""

    rows: torch.Tensor  # [G] position of each query in the step's row
    tables: torch.Tensor  # [G, ceil(ctx_len / block_size)]
    ctx_len: int


@dataclass
class AttentionMetadata:
    cache: KVCache
    slot_blocks: torch.Tensor  # [T] block id of every new token
    slot_offsets: torch.Tensor  # [T] offset inside its block
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSlice]
    num_padding: int = 0  # throwaway tokens at the end of the row (see runtime.row_padding)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    meta: AttentionMetadata = kwargs["ponder_attention"]
    layer = module.layer_idx
    cache = meta.cache
    # query [1, H, T, D]; key/value [1, KVH, T, D]
    cache.write(layer, meta.slot_blocks, meta.slot_offsets, key[0].transpose(0, 1), value[0].transpose(0, 1))
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, H, D]
    if meta.num_padding:
        out[-meta.num_padding:] = 0

    num_heads = query.shape[1]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    for group in meta.decode_groups:
        q = query[0, :, group.rows].transpose(0, 1).unsqueeze(2)  # [G, H, 1, D]
        k, v = cache.gather(layer, group.tables)
        k, v = k[:, :, :group.ctx_len], v[:, :, :group.ctx_len]
        if k.shape[1] != num_heads:  # grouped-query attention: each KV head serves a run of query heads
            k = k.repeat_interleave(num_heads // k.shape[1], dim=1)
            v = v.repeat_interleave(num_heads // v.shape[1], dim=1)
        weights = torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1, dtype=torch.float32).to(v.dtype)
        out[group.rows] = (weights @ v)[:, :, 0]

    for p in meta.prefills:
        q = query[:, :, p.q_start:p.q_start + p.q_len]
        if p.mask is None:
            k = key[:, :, p.q_start:p.q_start + p.q_len]
            v = value[:, :, p.q_start:p.q_start + p.q_len]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            k, v = cache.gather(layer, p.block_table)
            k, v = k[:, :, :p.ctx_len], v[:, :, :p.ctx_len]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, scale=scaling, enable_gqa=True)
        out[p.q_start:p.q_start + p.q_len] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    return None


def register() -> str:
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME
