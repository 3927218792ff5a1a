"""Paged attention plugged into transformers' attention-function registry.

The runner flattens every scheduled sequence's new tokens into one row (batch 1, T tokens) with
their true position ids, so any decoder-only transformers model computes its projections and
rotary embeddings unchanged. Our attention function then writes the new keys/values into their
paged slots and attends each sequence's queries to its own blocks.

Generated tokens (decoded, or recomputed after their blocks were given up) are attended one query
at a time with plain batched matmuls and a softmax, in groups of equal bucketed context width
(`bucket_blocks`): every query reads a window of its own blocks as wide as its bucket, and the
positions at or past its own context length get a weight of exactly 0 (and read the query's own
position 0 rather than their slots, so garbage in a stale or scratch slot cannot turn 0 into NaN).
A window's keys and values are read with one `index_select` of cache rows the runner computed
once for the step (`DecodeGroup.kv_rows`), offset per layer. The shapes of a query's
matmuls depend only on its own context length, so its result is the same bits whatever else is in
the batch, and a token recomputed later gets the KV it had when it was decoded. The query heads
that share a KV head are one matmul against that head (no copies of K/V per query head). Scores
and the softmax are computed in float32. Prompts are prefilled with SDPA.

On a CPU with a float32 or bfloat16 cache, generated tokens are attended by ponder's own kernel instead
(`DecodeRows`, runtime/kernels/csrc/decode_attention.cpp): each query reads exactly its own context from
its blocks where they lie, with nothing gathered and nothing padded, in an order fixed per query,
so it keeps both properties above (a query's bits never depend on the batch, and a recomputed
token gets the KV it had). It computes in float32: a bfloat16 model's queries are widened for it
and its output rounded back to bfloat16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

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


def bucket_blocks(num_blocks: int) -> int:
    """The window, in blocks, a query needing `num_blocks` blocks reads: `num_blocks` rounded up to
    two significant bits (1, 2, 3, 4, 6, 8, 12, 16, 24, ...), so at most a third of a window is
    padding and the number of distinct windows grows with the log of the context."""
    if num_blocks <= 2:
        return num_blocks
    step = 1 << (num_blocks.bit_length() - 2)
    return -(-num_blocks // step) * step


@dataclass
class DecodeGroup:
    """Queries that each attend to their own context through a window of `width` tokens."""

    rows: torch.Tensor  # [G] position of each query in the step's row
    # [2, G, KVH, width] rows of `KVCache.rows` holding layer 0's keys (0) and values (1) of each
    # query's window; a layer's are these plus `layer * KVCache.layer_rows`. Positions at or past a
    # query's context read its position 0 instead, which is finite (it is always computed first).
    kv_rows: torch.Tensor
    masked: torch.Tensor  # [G, 1, 1, width] bool: True at positions >= the query's context length
    width: int


@dataclass
class DecodeRows:
    """Every generated token of the step, for ponder's CPU decode attention kernel."""

    rows: torch.Tensor  # [G] position of each query in the step's row
    tables: torch.Tensor  # [G, W] each query's block table (padded past its context)
    ctx: torch.Tensor  # [G] each query's context length
    kernel: object  # torch.ops.ponder.decode_attention, or on a GPU runtime.kernels.gpu.paged.decode_attention
    widen: bool = True  # the kernel computes with float32 queries (the CPU kernel); False: any dtype (Triton)


class LayerHooks(Protocol):
    """Where a step's KV lives, layer by layer (runtime.kv.residency): `before_layer(layer)` runs ahead
    of the layer's cache reads and writes, `after_layer(layer)` once the layer is done with them."""

    def before_layer(self, layer: int) -> None: ...

    def after_layer(self, layer: int) -> None: ...


@dataclass
class AttentionMetadata:
    cache: KVCache
    slot_rows: torch.Tensor  # [2, T, KVH] rows of `KVCache.rows` where layer 0's new keys and values go
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSlice]
    num_padding: int = 0  # throwaway tokens at the end of the row (see runtime.model.row_padding)
    decode_only: bool = False  # one decode group holding every row of the step, in order
    layers: LayerHooks | None = None  # None: every layer of every block the step reads is resident
    decode_rows: DecodeRows | None = None  # instead of decode_groups, where the CPU kernel runs
    # The residency's own attention of each layer (layer, queries, keys, values, scaling) -> output, when it
    # holds the step's KV itself (head-wise, runtime.kv.headwise): nothing of the step is in the cache.
    attention: Callable[..., torch.Tensor] | None = None
    # The step's sequences as the linear-attention layers see them (runtime.model.recurrent.RecurrentStep)
    recurrent: object | None = None
    # Where the sliding layers' KV is kept apart (runtime.kv.window_split): their cache, slots and tables;
    # this metadata's cache then holds the other layers'
    window: "WindowedLayers | None" = None


@dataclass
class WindowedLayers:
    """The step's view of the sliding layers' cache, whose blocks before a sequence's window are released
    (their table entries read its scratch block): each model layer's place, `places[layer]` = (whether
    it is a sliding layer, its index in its group's cache)."""

    meta: AttentionMetadata
    places: tuple[tuple[bool, int], ...]
    window: int  # the widest window of the sliding layers: blocks before it were released

    def route(self, meta: AttentionMetadata, layer: int, window: int | None) -> tuple[AttentionMetadata, int]:
        """(the metadata of `layer`'s cache, its index there); a sliding layer attending further back than
        the released blocks stops the step (a released block is never read)."""
        sliding, index = self.places[layer]
        if not sliding:
            return meta, index
        if not window or window > self.window:
            raise RuntimeError(f"layer {layer} attends {window or 'every'} position(s) back, past the sliding "
                               f"window of {self.window} whose earlier blocks are released")
        return self.meta, index


# Attention features some transformers families pass that this function does not implement: a
# model passing one is stopped with its name rather than attended without it.
_UNHONOURED = ("sinks", "position_bias", "indices", "block_indices")


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function transformers' modules call: query `[1, H, T, D]`, key/value `[1, KVH, T, D]`.
    Gemma 2's `softcap` (attention-logit soft-capping), `sliding_window` (local layers) and gpt-oss's
    `s_aux` (attention sinks) are honoured; any other attention feature stops the step, naming it."""
    for name in _UNHONOURED:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"ponder's paged attention does not implement {name!r} "
                                      f"({type(module).__name__})")
    if kwargs.get("is_causal") is False:
        raise NotImplementedError(f"ponder's paged attention is causal; {type(module).__name__} is not")
    out = attend(kwargs["ponder_attention"], module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                 value[0].transpose(0, 1), scaling, softcap=kwargs.get("softcap"), window=kwargs.get("sliding_window"),
                 sinks=kwargs.get("s_aux"))
    return out.unsqueeze(0), None


def attend(meta: AttentionMetadata, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           scaling: float | None, *, softcap: float | None = None, window: int | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Write the step's new keys and values `[T, KVH, D]` of `layer` and attend its queries `[T, H, D]`;
    returns `[T, H, D]`. `softcap`: scores become softcap * tanh(score / softcap); `window`: a query at
    position p attends to positions p - window + 1 .. p only (transformers' sliding window); `sinks` `[H]`:
    one more logit per head in the softmax's denominator, whose weight goes to no value (gpt-oss)."""
    if meta.attention is not None:
        lacking = [name for name, used in (("attention sinks", sinks is not None), ("soft-capping", bool(softcap)),
                                           ("a sliding window", bool(window))) if used]
        if lacking:
            raise NotImplementedError(f"the head-wise KV residency does not apply {' or '.join(lacking)}")
        return meta.attention(layer, queries, keys, values, scaling)
    if meta.window is not None:
        meta, layer = meta.window.route(meta, layer, window)
    head_dim = queries.shape[-1]
    narrow = tuple(keys.shape[1:]) != (meta.cache.shape.num_kv_heads, meta.cache.shape.head_dim)
    if narrow:
        scaling = scaling if scaling is not None else head_dim ** -0.5
        queries, keys, values = _widened(meta.cache.shape, queries, keys, values)
    if meta.layers is not None:
        meta.layers.before_layer(layer)
    out = _attend(meta, layer, queries, keys, values, scaling, softcap or None, window or None, sinks)
    if meta.layers is not None:
        meta.layers.after_layer(layer)
    return out[..., :head_dim] if narrow else out


def _widened(shape, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
    """A layer narrower than the cache (Gemma 4's sliding layers beside its wider global ones, see
    storage.kv_cache.attention_sizes), as the cache's width: each KV head repeated for the query heads
    that read it, keys, values and queries padded with zeros to the cache's head size. The scores are
    the layer's own (a zero adds nothing to a dot product) and so are the outputs' first `head_dim` values."""
    num_kv_heads = keys.shape[1]
    if shape.num_kv_heads % num_kv_heads or queries.shape[1] % shape.num_kv_heads:
        raise NotImplementedError(f"a layer of {num_kv_heads} KV heads beside the cache's {shape.num_kv_heads} "
                                  f"for {queries.shape[1]} query heads")
    repeat = shape.num_kv_heads // num_kv_heads
    if repeat > 1:  # query head i reads KV head i // (H / KVH): the same head after repeat_interleave
        keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
    pad = shape.head_dim - keys.shape[-1]
    if pad:
        queries, keys, values = (F.pad(x, (0, pad)) for x in (queries, keys, values))
    return queries, keys, values


def _attend(meta: AttentionMetadata, layer: int, queries, keys, values, scaling, softcap, window, sinks):
    cache = meta.cache
    cache.write_rows(layer, meta.slot_rows, keys, values)
    num_tokens, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    shared = num_heads // num_kv_heads
    scale = scaling if scaling is not None else head_dim ** -0.5
    rows = cache.rows()
    layer_offset = layer * cache.layer_rows
    out = None
    if not meta.decode_only or meta.decode_rows is not None:
        out = queries.new_empty(num_tokens, num_heads, head_dim)
        if meta.num_padding:
            out[-meta.num_padding:] = 0
    if meta.decode_rows is not None:
        d = meta.decode_rows
        kernel_sinks = None if sinks is None else sinks.detach().float().contiguous()
        if queries.dtype != torch.float32 and d.widen:  # a bfloat16 model: widened, the output rounded back
            attended = out.new_zeros(out.shape, dtype=torch.float32)
            # (widened row-major: transformers' own forward (Qwen3.5's) passes [T, H, D] as a transposed view,
            # gpt-oss's rotary leaves [H, T, D] contiguous; .float() keeps the strides)
            d.kernel(queries.float().contiguous(), d.rows, cache.kv, d.tables, d.ctx, layer, scale, attended,
                     float(softcap or 0), int(window or 0), kernel_sinks)
            out.copy_(attended)
        else:
            if queries.stride(1) != head_dim:  # transformers' own forward: [T, H, D] as a transposed view
                queries = queries.contiguous()
            d.kernel(queries, d.rows, cache.kv, d.tables, d.ctx, layer, scale, out, float(softcap or 0),
                     int(window or 0), kernel_sinks)
    for group in meta.decode_groups:
        g = group.rows.shape[0]
        # Query heads h*r .. h*r+r-1 share KV head h (grouped-query attention): [G, KVH, r, D].
        q = queries.reshape(g, num_kv_heads, shared, head_dim) if out is None else \
            queries.index_select(0, group.rows).view(g, num_kv_heads, shared, head_dim)
        kv = rows.index_select(0, (group.kv_rows + layer_offset).view(-1)).view(2, g, num_kv_heads, group.width,
                                                                               head_dim)
        k, v = kv.unbind(0)
        if k.dtype != torch.float32:
            q, k = q.float(), k.float()
        scores = _capped(torch.matmul(q, k.transpose(-1, -2)) * scale, softcap)
        masked = group.masked
        if window is not None:  # positions before the query's window: its context less `window`
            ctx = (~masked).sum(-1, keepdim=True)
            masked = masked | (torch.arange(group.width, device=ctx.device) < ctx - window)
        # A masked position's weight is exactly 0 and its value finite (see DecodeGroup.kv_rows).
        # Query head h * shared + j is sink h * shared + j: [KVH, shared, 1] against [G, KVH, shared, width].
        weights = _softmax(scores.masked_fill_(masked, float("-inf")),
                           None if sinks is None else sinks.view(num_kv_heads, shared, 1))
        attended = torch.matmul(weights if weights.dtype == v.dtype else weights.to(v.dtype), v)
        if out is None:  # the step's only group, every row in order
            return attended.view(g, num_heads, head_dim)
        out.index_copy_(0, group.rows, attended.view(g, num_heads, head_dim))

    for p in meta.prefills:
        q = queries[p.q_start:p.q_start + p.q_len].transpose(0, 1)[None]
        if softcap is not None or window is not None or sinks is not None:  # beyond SDPA: the plain arithmetic
            if p.mask is None:
                k = keys[p.q_start:p.q_start + p.q_len].transpose(0, 1)[None]
                v = values[p.q_start:p.q_start + p.q_len].transpose(0, 1)[None]
            else:
                k, v = cache.gather(layer, p.block_table)
                k, v = k[:, :, :p.ctx_len], v[:, :, :p.ctx_len]
            o = _prefill_capped(q, k, v, p.ctx_len, scale, softcap, window, sinks)
        elif p.mask is None:
            k = keys[p.q_start:p.q_start + p.q_len].transpose(0, 1)[None]
            v = values[p.q_start:p.q_start + p.q_len].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            k, v = cache.gather(layer, p.block_table)
            k, v = k[:, :, :p.ctx_len], v[:, :, :p.ctx_len]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, scale=scaling, enable_gqa=True)
        out[p.q_start:p.q_start + p.q_len] = o[0].transpose(0, 1)
    return out


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The softmax over the last dimension of `scores`, with `sinks` (broadcast to `scores` but for its
    last dimension, one logit per head) in the denominator: transformers' gpt-oss arithmetic (the sink
    joins the scores, the row's maximum is subtracted, the softmax taken, the sink's column dropped)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    combined = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1]


def _prefill_capped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int, scale: float,
                    softcap: float | None, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A prompt slice's attention in float32 with soft-capping, a sliding window and sinks: q `[1, H, Q, D]`
    at positions ctx_len - Q .. ctx_len - 1, k/v `[1, KVH, ctx_len, D]`; returns `[1, H, Q, D]`."""
    heads, q_len, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    k = k.float().repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = _capped(torch.matmul(q.float(), k.transpose(-1, -2)) * scale, softcap)
    query_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
    key_pos = torch.arange(ctx_len, device=q.device)[None, :]
    hidden = key_pos > query_pos
    if window is not None:
        hidden = hidden | (key_pos <= query_pos - window)
    weights = _softmax(scores.masked_fill_(hidden, float("-inf")), None if sinks is None else sinks.view(heads, 1, 1))
    return torch.matmul(weights.to(v.dtype), v)


def _no_mask(*args, **kwargs):
    return None


def register() -> str:
    """Register `paged_attention` with no mask (it builds its own from the positions it is given)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME
