"""The GPU path's Triton kernels (runtime/kernels/gpu) in Triton's interpreter, against torch's arithmetic,
and decode attention's batch invariance: a query's output bits alone are its bits in any batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.kernels.gpu.elementwise import act_mul, rms_norm
from runtime.kernels.gpu.paged import attention_inputs, decode_attention
from storage.kv_cache import KVCache, KVShape


def torch_rms_norm(x, weight, eps):
    wide = x.float()
    return weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_residual(dtype):
    gen = torch.Generator().manual_seed(0)
    x, res = (torch.randn(5, 48, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(48, generator=gen).to(dtype)
    out, summed = rms_norm(x, weight, 1e-6)
    assert summed is x
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.0625, rtol=0.016)
    torch.testing.assert_close(out, torch_rms_norm(x, weight, 1e-6), **tol)
    out, summed = rms_norm(x, weight, 1e-6, residual=res)
    if dtype == torch.float32:
        assert torch.equal(summed, x + res)  # the add rounds once, to the activations' dtype, as torch's
    else:  # (the interpreter rounds to bfloat16 toward zero, a GPU to nearest: one unit in the last place)
        torch.testing.assert_close(summed, x + res, atol=0.0, rtol=2 ** -7)
    torch.testing.assert_close(out, torch_rms_norm(x + res, weight, 1e-6), **tol)


def test_gemma_s_norm_of_a_sublayer_s_output_then_the_add_then_the_next_norm():
    """`hidden = residual + post_attention_layernorm(out)`, then `pre_feedforward_layernorm(hidden)`:
    Gemma 3's (1 + w) norms, in one launch."""
    from runtime.model.norms import OffsetRMSNorm

    gen = torch.Generator().manual_seed(7)
    out, residual = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen)
    after, before = (OffsetRMSNorm(torch.randn(48, generator=gen) * 0.3, 1e-6) for _ in range(2))
    normed, summed = rms_norm(out, before.scale, 1e-6, residual=residual, offset=True, pre=(after.scale, 1e-6))
    torch.testing.assert_close(summed, residual + after(out), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(normed, before(residual + after(out)), atol=1e-5, rtol=1e-5)


def test_gelu_mul_is_gemma_s_gelu_tanh_of_the_gate_times_up():
    gen = torch.Generator().manual_seed(8)
    gate_up = torch.randn(4, 2 * 40, generator=gen) * 3
    torch.testing.assert_close(act_mul(gate_up, 40, gelu=True),
                               F.gelu(gate_up[:, :40], approximate="tanh") * gate_up[:, 40:], atol=1e-5, rtol=1e-5)


def test_silu_mul():
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(4, 2 * 40, generator=gen)
    torch.testing.assert_close(act_mul(gate_up, 40), F.silu(gate_up[:, :40]) * gate_up[:, 40:],
                               atol=1e-6, rtol=1e-6)


def _cache(dtype=torch.float32, blocks=8):
    cache = KVCache(KVShape(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4), blocks, dtype,
                    torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(3)).to(dtype))
    return cache


def _rotation(tokens, dim, gen):
    angles = torch.randn(tokens, dim // 2, generator=gen)
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    return cos, torch.cat((-sin[:, :dim // 2], sin[:, dim // 2:]), -1)  # (rotate_half's sign in sin, as the decoder's)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [None, "qwen3", "gemma"])
@pytest.mark.parametrize("rotated", [True, False])
def test_attention_inputs_are_the_torch_loop_s_norms_rotary_and_kv_write(dtype, norm, rotated):
    """One launch for what the torch loop does in `queries_and_keys` and `KVCache.write_rows`: 4 query
    heads and 2 KV heads of a strided qkv, Qwen3's or Gemma's head norms (or none), the rotary (or none)."""
    from runtime.model.norms import OffsetRMSNorm, RMSNorm

    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, tokens = 4, 2, 16, 3
    wide = torch.randn(tokens, (heads + 2 * kv_heads) * dim + 5, generator=gen).to(dtype)
    qkv = wide[:, :(heads + 2 * kv_heads) * dim]  # (rows strided, as a slice of a wider output)
    cos, sin = _rotation(tokens, dim, gen)
    weights = torch.randn(2, dim, generator=gen).to(dtype)
    mine, theirs = _cache(dtype), _cache(dtype)
    slots = mine.row_index(torch.tensor([5, 0, 2]), torch.tensor([3, 1, 0]))
    queries = torch.empty(tokens, heads, dim, dtype=dtype)
    wider = torch.zeros(2, tokens + 2, kv_heads, dtype=torch.long)
    wider[:, :tokens] = slots  # (strided, as a static buffer's first rows: read in place)
    kind, normed = {None: None, "qwen3": RMSNorm, "gemma": OffsetRMSNorm}[norm], norm is not None
    given = None if kind is None else torch.stack([kind(w, 1e-6).scale if norm == "gemma" else w for w in weights])
    attention_inputs(qkv, heads, kv_heads, cos if rotated else None, sin if rotated else None, given, 1e-6,
                     queries, mine.kv, mine.layer_rows, 1, wider[:, :tokens], offset=norm == "gemma")
    qk = qkv[:, :(heads + kv_heads) * dim].reshape(tokens, heads + kv_heads, dim)
    if normed:
        qk = torch.cat((kind(weights[0], 1e-6)(qk[:, :heads]), kind(weights[1], 1e-6)(qk[:, heads:])), 1)
    if rotated:  # (in float32, rounded once: the kernel's rounding)
        qk = (qk.float() * cos[:, None] + torch.roll(qk.float(), dim // 2, -1) * sin[:, None]).to(dtype)
    value = qkv[:, (heads + kv_heads) * dim:].reshape(tokens, kv_heads, dim)
    theirs.write_rows(1, slots, qk[:, heads:], value)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0.0625, rtol=0.016)
    if not normed and not rotated or (dtype == torch.float32 and not normed):
        tol = dict(atol=0.0, rtol=0.0)  # (no norm: the same operations in the same order)
    torch.testing.assert_close(queries, qk[:, :heads], **tol)
    torch.testing.assert_close(mine.kv, theirs.kv, **tol)
    written = torch.zeros(mine.kv.numel() // dim, dtype=torch.bool)
    written[slots.flatten() + mine.layer_rows] = True
    assert torch.equal(mine.kv.view(-1, dim)[~written], theirs.kv.view(-1, dim)[~written])  # nothing else touched


def torch_attention(q, cache, layer, table, ctx, scale, window=0):
    """One query `[H, D]` against its first `ctx` positions, in float64."""
    k, v = cache.gather(layer, torch.tensor([table]))
    k, v = k[0, :, :ctx].double(), v[0, :, :ctx].double()
    shared = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(shared, 0), v.repeat_interleave(shared, 0)
    scores = torch.einsum("hd,htd->ht", q.double(), k) * scale
    if window:
        scores[:, :max(ctx - window, 0)] = float("-inf")
    return torch.einsum("ht,htd->hd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("window", [0, 5])
def test_decode_attention_matches_reference_and_is_batch_invariant(window):
    cache = _cache()
    gen = torch.Generator().manual_seed(5)
    queries = torch.randn(4, 4, 16, generator=gen)
    tables = torch.tensor([[3, 1, 6], [0, 2, 7], [5, 4, 3], [7, 7, 7]])
    ctx = torch.tensor([9, 1, 12, 4])
    rows = torch.arange(4)
    out = torch.zeros(4, 4, 16)
    decode_attention(queries, rows, cache.kv, tables, ctx, 1, 0.25, out, window=window)
    for i in range(4):
        expected = torch_attention(queries[i], cache, 1, tables[i].tolist(), int(ctx[i]), 0.25, window)
        torch.testing.assert_close(out[i].double(), expected, atol=1e-5, rtol=1e-5)
        alone = torch.zeros(1, 4, 16)
        decode_attention(queries[i:i + 1], torch.tensor([0]), cache.kv, tables[i:i + 1, :2 if ctx[i] <= 8 else 3],
                         ctx[i:i + 1], 1, 0.25, alone, window=window)
        assert torch.equal(alone[0], out[i])  # the same bits alone, with a narrower table, as in the batch


def test_decode_attention_bfloat16_and_sinks():
    cache = _cache(torch.bfloat16)
    gen = torch.Generator().manual_seed(6)
    queries = torch.randn(2, 4, 16, generator=gen).bfloat16()
    tables, ctx, rows = torch.tensor([[1, 2], [4, 0]]), torch.tensor([7, 3]), torch.tensor([1, 0])
    sinks = torch.randn(4, generator=gen)
    out = torch.zeros(2, 4, 16, dtype=torch.bfloat16)
    decode_attention(queries, rows, cache.kv, tables, ctx, 0, 0.25, out, sinks=sinks)
    for i, row in enumerate(rows.tolist()):
        k, v = cache.gather(0, tables[i:i + 1])
        k, v = (x[0, :, :int(ctx[i])].double().repeat_interleave(2, 0) for x in (k, v))
        scores = torch.einsum("hd,htd->ht", queries[row].double(), k) * 0.25
        scores = torch.cat((scores, sinks.double()[:, None]), -1)
        expected = torch.einsum("ht,htd->hd", torch.softmax(scores, -1)[:, :-1], v)
        torch.testing.assert_close(out[row].double(), expected, atol=0.02, rtol=0.02)
