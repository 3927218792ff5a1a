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
def _write_kv(key_ptr, value_ptr, rows_ptr, cache_ptr, layer_offset, tokens, heads, key_stride, value_stride,
              D: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    inside = d < D
    key_row = tl.load(rows_ptr + token * heads + head).to(tl.int64) + layer_offset
    value_row = tl.load(rows_ptr + (tokens + token) * heads + head).to(tl.int64) + layer_offset
    key = tl.load(key_ptr + token * key_stride + head * D + d, mask=inside)
    value = tl.load(value_ptr + token * value_stride + head * D + d, mask=inside)
    tl.store(cache_ptr + key_row * D + d, key, mask=inside)
    tl.store(cache_ptr + value_row * D + d, value, mask=inside)


def write_kv(kv: torch.Tensor, layer_rows: int, layer: int, slot_rows: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> None:
    """`KVCache.write_rows` as one kernel: `key`, `value` `[T, KVH, D]` (heads contiguous, tokens may
    be strided) stored at `slot_rows` `[2, T, KVH]` (layer 0's rows) of layer `layer`."""
    tokens, heads, dim = key.shape
    assert key.stride(2) == 1 and key.stride(1) == dim and value.stride(2) == 1 and value.stride(1) == dim
    assert slot_rows.shape == (2, tokens, heads) and key.shape == value.shape
    if tokens:
        _write_kv[(tokens, heads)](key, value, slot_rows.contiguous(), kv, layer * layer_rows, tokens, heads,
                                   key.stride(0), value.stride(0), D=dim, BLOCK=triton.next_power_of_2(dim))


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
