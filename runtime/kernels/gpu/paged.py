"""The KV write and decode attention over ponder's block layout (storage.kv_cache), as Triton kernels.

Decode attention runs one program per (query, head): it reads the query's own blocks through its
block table, a block at a time in order, with an online softmax in float32. No reduction crosses
programs and the loop's order depends only on the query's context length, so a query's output is the
same bits whatever the batch (batch-invariant by construction, as the CPU kernel is), and a token
recomputed later gets the KV it had. Its arguments are the CPU kernel's
(runtime.model.attention.DecodeRows), so the attention code calls either the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _attention_inputs(qkv_ptr, cos_ptr, sin_ptr, norms_ptr, eps, q_ptr, rows_ptr, cache_ptr, layer_offset, rows_stride,
                      rows_token_stride, qkv_stride, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                      HAS_NORM: tl.constexpr, OFFSET: tl.constexpr, HAS_ROTARY: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)  # a query head, then (from HEADS on) a key head with its value head
    d = tl.arange(0, BLOCK)
    inside = d < D
    base = qkv_ptr + token * qkv_stride + head * D
    x = tl.load(base + d, mask=inside, other=0.0)
    half = (d + D // 2) % D
    rolled = tl.load(base + half, mask=inside, other=0.0)
    if HAS_NORM:  # an RMS norm over the head, the weight q's or k's
        wide = x.to(tl.float32)
        scale = tl.rsqrt(tl.sum(wide * wide, axis=0) / D + eps)
        weights = norms_ptr + (head >= HEADS).to(tl.int32) * D
        if OFFSET:  # Gemma's: x * rsqrt(mean(x^2) + eps) * (1 + w) in float32 (`norms` 1 + w), rounded once
            x = (wide * scale * tl.load(weights + d, mask=inside, other=0.0)).to(x.dtype)
            rolled = (rolled.to(tl.float32) * scale * tl.load(weights + half, mask=inside, other=0.0)).to(x.dtype)
        else:  # Qwen3's: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)
            x = (tl.load(weights + d, mask=inside, other=0.0).to(tl.float32) *
                 (wide * scale).to(x.dtype).to(tl.float32)).to(x.dtype)
            rolled = (tl.load(weights + half, mask=inside, other=0.0).to(tl.float32) *
                      (rolled.to(tl.float32) * scale).to(x.dtype).to(tl.float32)).to(x.dtype)
    if HAS_ROTARY:  # x * cos + roll(x, D / 2) * sin (rotate_half's sign in `sin`), rounded once
        cos = tl.load(cos_ptr + token * D + d, mask=inside, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + token * D + d, mask=inside, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * cos + rolled.to(tl.float32) * sin).to(x.dtype)
    if head < HEADS:
        tl.store(q_ptr + (token * HEADS + head) * D + d, x.to(q_ptr.dtype.element_ty), mask=inside)
    else:
        kv_head = head - HEADS
        key_row = tl.load(rows_ptr + token * rows_token_stride + kv_head).to(tl.int64) + layer_offset
        value_row = tl.load(rows_ptr + rows_stride + token * rows_token_stride + kv_head).to(tl.int64) + layer_offset
        value = tl.load(base + KV_HEADS * D + d, mask=inside)
        tl.store(cache_ptr + key_row * D + d, x.to(cache_ptr.dtype.element_ty), mask=inside)
        tl.store(cache_ptr + value_row * D + d, value.to(cache_ptr.dtype.element_ty), mask=inside)


def attention_inputs(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor | None, sin: torch.Tensor | None,
                     norms: torch.Tensor | None, eps: float, queries: torch.Tensor, kv: torch.Tensor, layer_rows: int,
                     layer: int, slot_rows: torch.Tensor, offset: bool = False) -> None:
    """A decode layer's qkv projection `[T, (H + 2 KVH) * D]` made ready to attend, in one launch: each
    query and key head normed (`norms` `[2, D]`: q's weight, then k's; None: no head norms, Qwen3 has
    them; `offset`: Gemma's norms, `norms` their float32 1 + w) and rotated (`cos`, `sin` `[T, D]`, rotate_half's sign in `sin`'s first half; None: the layer does not rotate),
    the queries written to `queries` `[T, H, D]`, the keys and values stored in layer `layer` of `kv` at
    `slot_rows` `[2, T, KVH]` (layer 0's rows, as `KVCache.write_rows` takes them; keys and values, and
    tokens, may be strided). The arithmetic is transformers': the
    norm rounds where Qwen3RMSNorm does, the rotary once (as `rotary`)."""
    tokens = qkv.shape[0]
    dim = queries.shape[2]
    assert qkv.stride(1) == 1 and qkv.shape[1] == (heads + 2 * kv_heads) * dim and queries.is_contiguous()
    assert slot_rows.shape == (2, tokens, kv_heads) and slot_rows.stride(2) == 1
    assert queries.shape[:2] == (tokens, heads) and dim % 2 == 0
    if not tokens:
        return
    rotary = cos is not None
    _attention_inputs[(tokens, heads + kv_heads)](
        qkv, cos.contiguous() if rotary else qkv, sin.contiguous() if rotary else qkv,
        qkv if norms is None else norms.contiguous(), float(eps), queries, slot_rows, kv, layer * layer_rows,
        slot_rows.stride(0), slot_rows.stride(1), qkv.stride(0), HEADS=heads, KV_HEADS=kv_heads, D=dim,
        BLOCK=triton.next_power_of_2(dim), HAS_NORM=norms is not None, OFFSET=offset, HAS_ROTARY=rotary)


@triton.jit
def _decode_attention(q_ptr, rows_ptr, kv_ptr, tables_ptr, ctx_ptr, out_ptr, sinks_ptr, layer, scale, softcap,
                      window, q_stride, q_head_stride, out_stride, table_stride, num_layers,
                      HEADS: tl.constexpr, KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    query = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (HEADS // KV_HEADS)
    row = tl.load(rows_ptr + query).to(tl.int64)
    ctx = tl.load(ctx_ptr + query)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BLOCK_SIZE)
    dim_ok = d < D
    q = tl.load(q_ptr + row * q_stride + head * q_head_stride + d, mask=dim_ok, other=0.0).to(tl.float32)
    first = ctx - tl.minimum(ctx, window)  # (no window: `window` is larger than any context)
    m = tl.full((), -1.0e30, tl.float32)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    b = first // BLOCK_SIZE
    end = (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE
    while b < end:  # (a while loop: Triton's interpreter cannot range over a loaded value)
        block = tl.load(tables_ptr + query * table_stride + b).to(tl.int64)
        # (block, layer, key 0 / value 1, kv head, offset, dim)
        key_base = (((block * num_layers + layer) * 2) * KV_HEADS + kv_head) * BLOCK_SIZE * D
        value_base = key_base + KV_HEADS * BLOCK_SIZE * D
        offs = t[:, None] * D + d[None, :]
        tile_ok = dim_ok[None, :]
        k = tl.load(kv_ptr + key_base + offs, mask=tile_ok, other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        if HAS_SOFTCAP:
            capped = scores / softcap
            scores = softcap * (2.0 / (1.0 + tl.exp(-2.0 * capped)) - 1.0)
        position = b * BLOCK_SIZE + t
        scores = tl.where((position < ctx) & (position >= first), scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        v = tl.load(kv_ptr + value_base + offs, mask=tile_ok, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        total = total * alpha + tl.sum(p, axis=0)
        m = m_new
        b += 1
    if HAS_SINKS:  # one more logit in the denominator whose weight goes to no value (gpt-oss)
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_new = tl.maximum(m, sink)
        alpha = tl.exp(m - m_new)
        acc = acc * alpha
        total = total * alpha + tl.exp(sink - m_new)
    tl.store(out_ptr + row * out_stride + head * D + d, (acc / total).to(out_ptr.dtype.element_ty), mask=dim_ok)


def decode_attention(queries: torch.Tensor, rows: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor,
                     ctx: torch.Tensor, layer: int, scale: float, out: torch.Tensor, softcap: float = 0.0,
                     window: int = 0, sinks: torch.Tensor | None = None) -> None:
    """Attend query `rows[i]` of `queries` `[T, H, D]` to its first `ctx[i]` positions (the last `window`
    of them where `window` > 0) through block table `tables[i]`, in layer `layer` of `kv` (the cache's
    `[blocks, layers, 2, KVH, block_size, D]`); write `out[rows[i]]` `[H, D]`. `softcap` > 0: scores
    become softcap * tanh(score / softcap); `sinks` `[H]`: gpt-oss's sink logits."""
    num_queries = rows.shape[0]
    heads, dim = queries.shape[1], queries.shape[2]
    _, num_layers, _, kv_heads, block_size, cache_dim = kv.shape
    assert cache_dim == dim and queries.stride(2) == 1 and heads % kv_heads == 0
    assert out.is_contiguous() and out.shape[1:] == (heads, dim) and out.shape[0] >= queries.shape[0]
    assert block_size & (block_size - 1) == 0, "the kernel reads a block as one tile: a power-of-two block size"
    if not num_queries:
        return
    _decode_attention[(num_queries, heads)](
        queries, rows, kv, tables, ctx, out, queries if sinks is None else sinks, layer, scale, float(softcap),
        int(window) if window > 0 else 1 << 30, queries.stride(0), queries.stride(1), out.stride(0), tables.stride(0), num_layers,
        HEADS=heads, KV_HEADS=kv_heads, BLOCK_SIZE=block_size, D=dim, BLOCK_D=triton.next_power_of_2(dim),
        HAS_SINKS=sinks is not None, HAS_SOFTCAP=bool(softcap))
