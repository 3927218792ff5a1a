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
def _quantized(x_rows, rk, mask, INS: tl.constexpr, ACT: tl.constexpr):
    """A group of 32 inputs of each row `[rows, 32]` (`_inputs`' with `ACT`) as int32 codes q in -127..127 and
    the float32 scale s `[rows]` they are multiplied by: x ~ s * q."""
    x = _inputs(x_rows, rk, mask, INS, ACT).to(tl.float32)
    top = tl.max(tl.abs(x), axis=1)
    inverse = tl.where(top > 0.0, 127.0 / tl.where(top > 0.0, top, 1.0), 0.0)  # (a row of zeros: q 0, s 0)
    q = tl.fma(x, inverse[:, None], ROUND) - ROUND  # (the exact product rounded once)
    return q.to(tl.int32), top / 127.0


@triton.jit
def _products(q, c, DOT: tl.constexpr):
    """<q, c> over a group: q `[rows, 32]` and c `[outs, 32]` int32 -> `[rows, outs]` int32, exact."""
    if DOT:
        return tl.dot(q.to(tl.int8), tl.trans(c.to(tl.int8)), out_dtype=tl.int32)
    return tl.sum(q[:, None, :] * c[None, :, :], axis=2)


@triton.jit
def _int8_linear(x_ptr, w_ptr, h_ptr, d_ptr, m_ptr, ds_ptr, ms_ptr, out_ptr, outs, rows, x_stride, w_stride,
                 h_stride, d_stride, ds_stride, out_stride, INS: tl.constexpr, GROUP: tl.constexpr,
                 HAS_M: tl.constexpr, SUPER: tl.constexpr, PACKED: tl.constexpr, HIGH: tl.constexpr,
                 OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLITS: tl.constexpr, CHUNK: tl.constexpr, ACT: tl.constexpr):
    """`BLOCK_M` rows (past the last, zeros) times `BLOCK_N` outputs a program, over the inputs
    `split * CHUNK` to `(split + 1) * CHUNK` a group of 32 at a time, in order."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_ok, out_ok = rm < rows, rn < outs
    DOT: tl.constexpr = BLOCK_M > 1
    half = tl.arange(0, 32)[None, :] < 16
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for i in range(0, CHUNK, BLOCK_K):
        for j in tl.static_range(0, BLOCK_K, 32):
            k0 = split * CHUNK + i + j
            rk = k0 + tl.arange(0, 32)
            q, s = _quantized(x_ptr + rm[:, None] * x_stride, rk[None, :], row_ok[:, None] & (rk[None, :] < INS),
                              INS, ACT)
            c = _codes(w_ptr, h_ptr, rn, out_ok, k0, w_stride, h_stride, INS, PACKED, HIGH, OFFSET, BLOCK_N, 32, True)
            g = k0 // GROUP
            if GROUP == 32:
                d, m = _scales(d_ptr, m_ptr, ds_ptr, ms_ptr, rn, out_ok, g, d_stride, ds_stride, INS // GROUP, HAS_M,
                               SUPER)
                acc = tl.fma(d[None, :], _products(q, c, DOT).to(tl.float32) * s[:, None], acc)
                if HAS_M:
                    acc = tl.fma(m[None, :], (s * tl.sum(q, axis=1).to(tl.float32))[:, None], acc)
            else:  # two groups of 16 codes: each half's products, from codes of the other half zeroed
                d0, m0 = _scales(d_ptr, m_ptr, ds_ptr, ms_ptr, rn, out_ok, g, d_stride, ds_stride, INS // GROUP,
                                 HAS_M, SUPER)
                d1, m1 = _scales(d_ptr, m_ptr, ds_ptr, ms_ptr, rn, out_ok, g + 1, d_stride, ds_stride, INS // GROUP,
                                 HAS_M, SUPER)
                first = _products(q, tl.where(half, c, 0), DOT).to(tl.float32)
                second = _products(q, tl.where(half, 0, c), DOT).to(tl.float32)
                acc = tl.fma(d0[None, :], first * s[:, None], acc)
                acc = tl.fma(d1[None, :], second * s[:, None], acc)
                if HAS_M:
                    low = tl.sum(tl.where(half, q, 0), axis=1).to(tl.float32)
                    high = tl.sum(tl.where(half, 0, q), axis=1).to(tl.float32)
                    acc = tl.fma(m0[None, :], (s * low)[:, None], acc)
                    acc = tl.fma(m1[None, :], (s * high)[:, None], acc)
    keep = row_ok[:, None] & out_ok[None, :]
    if SPLITS == 1:
        tl.store(out_ptr + rm[:, None] * out_stride + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=keep)
    else:  # a split's float32 sums `[SPLITS, rows, outs]`, added up in order by linear's `_sum_splits`
        tl.store(out_ptr + (split * rows + rm[:, None]) * outs + rn[None, :], acc, mask=keep)
