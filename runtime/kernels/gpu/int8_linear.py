"""The block GEMM with its inputs quantized to int8 per group of 32, as ponder's CPU kernels and llama.cpp
quantize them for a GGUF's blocks (runtime/kernels/csrc/q4_linear.cpp): a group's products with the codes
are summed as integers, exactly, so the order they are summed in never shows in a bit.

A row's group of 32 inputs x: top = max |x|, q = x * (127 / top) rounded to the nearest (ties to even),
s = top / 127. A group of codes c with scales d (and m) adds d * (<q, c> * s), then m * (s * sum q), to an
output's float32 sum, each a fused multiply-add, groups in order (a group of 16 codes, Q2_K's, Q3_K's
and Q6_K's: both halves' d terms, then both m terms, as the CPU kernel adds them). <q, c> is an integer
below 2^24 (|q| <= 127, |c| <= 128, 32 of them), exact whichever way it is summed, and so is sum q.

So one kernel serves a row alone and sixteen at once with the same bits (`_int8_linear`): with
`BLOCK_M` 1 a program sums a row's products on the CUDA cores (a GEMV, for a stream alone); with 16 it
multiplies sixteen rows by each code once on the tensor cores' integer units (`tl.dot` of int8 into
int32, for a search's beams). Every tile of one sum order (their splits and chunks: `linear.sum_order`)
gives a row the same bits whatever its rows a program, outputs a program or warps, so a layer may take a
different tile for each row count and a row still keeps its bits in any batch
(runtime.model.gpu_tiles chooses them on the GPU at start-up).
"""

from __future__ import annotations

import triton
import triton.language as tl

from runtime.kernels.gpu.block_codes import _codes, _inputs, _scales

ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: v + ROUND - ROUND is v rounded to the nearest integer, ties to even (|v| < 2^22)


@triton.jit
def _quantized(x):
    """Groups of 32 inputs `[groups, 32]` float32 as int32 codes q in -127..127 and the float32 scale s
    `[groups]` they are multiplied by: x ~ s * q."""
    top = tl.max(tl.abs(x), axis=1)
    inverse = tl.where(top > 0.0, 127.0 / tl.where(top > 0.0, top, 1.0), 0.0)  # (a group of zeros: q 0, s 0)
    q = tl.fma(x, inverse[:, None], ROUND) - ROUND  # (the exact product rounded once)
    return q.to(tl.int32), top / 127.0


@triton.jit
def _products(q, c):
    """<q, c> over a group on the tensor cores: q `[rows, 32]` and c `[outs, 32]` int32 -> `[rows, outs]`
    int32, exact."""
    return tl.dot(q.to(tl.int8), tl.trans(c.to(tl.int8)), out_dtype=tl.int32)


@triton.jit
def _add_group(acc, first, second, low, high, s, d_ptr, m_ptr, ds_ptr, ms_ptr, rn, out_ok, g, d_stride, ds_stride,
               GROUPS: tl.constexpr, HAS_M: tl.constexpr, SUPER: tl.constexpr, HALVES: tl.constexpr):
    """`acc` `[rows, outs]` plus a group of 32 inputs' terms, in the order the CPU kernel adds them: d * (<q, c> * s)
    (with `HALVES`, groups `g` and `g + 1` of 16 codes: `first`'s then `second`'s), then m * (s * sum q)
    (`low`'s, then `high`'s). `first`, `second` `[rows, outs]` and `low`, `high` `[rows]` int32, s `[rows]`."""
    d0, m0 = _scales(d_ptr, m_ptr, ds_ptr, ms_ptr, rn, out_ok, g, d_stride, ds_stride, GROUPS, HAS_M, SUPER)
    acc = tl.fma(d0[None, :], first.to(tl.float32) * s[:, None], acc)
    if HALVES:
        d1, m1 = _scales(d_ptr, m_ptr, ds_ptr, ms_ptr, rn, out_ok, g + 1, d_stride, ds_stride, GROUPS, HAS_M, SUPER)
        acc = tl.fma(d1[None, :], second.to(tl.float32) * s[:, None], acc)
    if HAS_M:
        acc = tl.fma(m0[None, :], (s * low.to(tl.float32))[:, None], acc)
        if HALVES:
            acc = tl.fma(m1[None, :], (s * high.to(tl.float32))[:, None], acc)
    return acc


@triton.jit
def _pick(values, at, index):
    """Column `index` of `values` `[rows, n]` (`at` its columns' numbers `[n]`) as `[rows]`: the one value and
    zeros summed, so exactly that value (an integer, or a float that is never -0.0 where it matters)."""
    return tl.sum(tl.where(at[None, :] == index, values, 0), axis=1)


@triton.jit
def _int8_linear(x_ptr, w_ptr, h_ptr, d_ptr, m_ptr, ds_ptr, ms_ptr, out_ptr, outs, rows, x_stride, w_stride,
                 h_stride, d_stride, ds_stride, out_stride, INS: tl.constexpr, GROUP: tl.constexpr,
                 HAS_M: tl.constexpr, SUPER: tl.constexpr, PACKED: tl.constexpr, HIGH: tl.constexpr,
                 OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLITS: tl.constexpr, CHUNK: tl.constexpr, ACT: tl.constexpr):
    """`BLOCK_M` rows (past the last, zeros) times `BLOCK_N` outputs a program, over the inputs
    `split * CHUNK` to `(split + 1) * CHUNK`, a group of 32 inputs' terms at a time, in order. With one row
    a program a chunk's codes load at once (wide loads) and its groups' integer sums come out of one
    product, each group's then picked out exactly; with more, a group's codes multiply the rows on the
    tensor cores."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_ok, out_ok = rm < rows, rn < outs
    HALVES: tl.constexpr = GROUP == 16  # (Q2_K's, Q3_K's, Q6_K's groups of 16 codes)
    GROUPS: tl.constexpr = INS // GROUP
    x_rows = x_ptr + rm[:, None] * x_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for i in range(0, CHUNK, BLOCK_K):
        if BLOCK_M == 1:
            k0 = split * CHUNK + i
            rk = k0 + tl.arange(0, BLOCK_K)
            x = _inputs(x_rows, rk[None, :], row_ok[:, None] & (rk[None, :] < INS), INS, ACT).to(tl.float32)
            q, scales = _quantized(tl.reshape(x, (BLOCK_K // 32, 32)))
            PARTS: tl.constexpr = BLOCK_K // GROUP
            q = tl.reshape(q, (PARTS, GROUP))
            c = _codes(w_ptr, h_ptr, rn, out_ok, k0, w_stride, h_stride, INS, PACKED, HIGH, OFFSET, BLOCK_N, BLOCK_K,
                       True)
            sums = tl.sum(tl.reshape(c, (BLOCK_N, PARTS, GROUP)) * q[None, :, :], axis=2)  # [outs, parts], exact
            q_sums = tl.sum(q, axis=1)[None, :]
            parts, groups = tl.arange(0, PARTS), tl.arange(0, BLOCK_K // 32)
            for j in tl.static_range(0, BLOCK_K // 32):
                p = j * 2 if HALVES else j
                acc = _add_group(acc, _pick(sums, parts, p)[None, :], _pick(sums, parts, p + 1)[None, :],
                                 _pick(q_sums, parts, p), _pick(q_sums, parts, p + 1), _pick(scales[None, :], groups, j),
                                 d_ptr, m_ptr, ds_ptr, ms_ptr, rn, out_ok, k0 // GROUP + p, d_stride, ds_stride, GROUPS,
                                 HAS_M, SUPER, HALVES)
        else:
            half = tl.arange(0, 32)[None, :] < 16
            for j in tl.static_range(0, BLOCK_K, 32):
                k0 = split * CHUNK + i + j
                rk = k0 + tl.arange(0, 32)
                x = _inputs(x_rows, rk[None, :], row_ok[:, None] & (rk[None, :] < INS), INS, ACT).to(tl.float32)
                q, s = _quantized(x)
                c = _codes(w_ptr, h_ptr, rn, out_ok, k0, w_stride, h_stride, INS, PACKED, HIGH, OFFSET, BLOCK_N, 32,
                           True)
                if HALVES:  # each half's products, from codes of the other half zeroed
                    first = _products(q, tl.where(half, c, 0))
                    second = _products(q, tl.where(half, 0, c))
                    low = tl.sum(tl.where(half, q, 0), axis=1)
                    high = tl.sum(tl.where(half, 0, q), axis=1)
                else:
                    first = _products(q, c)
                    second = first
                    low = tl.sum(q, axis=1)
                    high = low
                acc = _add_group(acc, first, second, low, high, s, d_ptr, m_ptr, ds_ptr, ms_ptr, rn, out_ok,
                                 k0 // GROUP, d_stride, ds_stride, GROUPS, HAS_M, SUPER, HALVES)
    keep = row_ok[:, None] & out_ok[None, :]
    if SPLITS == 1:
        tl.store(out_ptr + rm[:, None] * out_stride + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=keep)
    else:  # a split's float32 sums `[SPLITS, rows, outs]`, added up in order by linear's `_sum_splits`
        tl.store(out_ptr + (split * rows + rm[:, None]) * outs + rn[None, :], acc, mask=keep)
