"""What every block GEMM loads (runtime/kernels/gpu/linear.py, int8_linear.py, routed.py): a GGUF's codes
as runtime.model.gpu_blocks holds them, a group's scales, and a row's inputs (with the gate/up product
computed as they are loaded). The unpacking exists once, so every kernel reads the same weights."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _codes(w_ptr, h_ptr, rn, out_ok, k0, w_stride, h_stride, INS: tl.constexpr, PACKED: tl.constexpr,
           HIGH: tl.constexpr, OFFSET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           INTS: tl.constexpr = False):
    """Outputs `rn`'s codes (or float weights) of inputs `k0` to `k0 + BLOCK_K`, `[BLOCK_N, BLOCK_K]` float32
    (int32 with `INTS`: codes, never float weights). A packed code is its low nibble (two a byte at
    `w_ptr`), with `HIGH` its two high bits (four a byte at `h_ptr`), less `OFFSET` (a signed code stored
    unsigned), in integers before it becomes a float."""
    if PACKED:  # two 4-bit codes a byte, input 2i in the low half, 2i + 1 in the high: one load a byte
        rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        byte = tl.load(w_ptr + rn[:, None] * w_stride + rb[None, :],
                       mask=out_ok[:, None] & (rb[None, :] < INS // 2), other=0)
        w = tl.reshape(tl.join(byte & 15, byte >> 4), (BLOCK_N, BLOCK_K)).to(tl.int32)
        if HIGH:  # input 4i's two high bits in bits 0-1 of byte i, 4i + 1's in 2-3, ...
            rh = k0 // 4 + tl.arange(0, BLOCK_K // 4)
            top = tl.load(h_ptr + rn[:, None] * h_stride + rh[None, :],
                          mask=out_ok[:, None] & (rh[None, :] < INS // 4), other=0)
            # (join's pairs inside pairs: a, c, b, d in order)
            top = tl.join(tl.join(top & 3, (top >> 4) & 3), tl.join((top >> 2) & 3, top >> 6))
            w = w | (tl.reshape(top, (BLOCK_N, BLOCK_K)).to(tl.int32) << 4)
        w = w - OFFSET
    else:
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn[:, None] * w_stride + rk[None, :], mask=out_ok[:, None] & (rk[None, :] < INS),
                    other=0)
    if INTS:  # (one return: a kernel's returns must agree in type)
        w = w.to(tl.int32)
    else:
        w = w.to(tl.float32)
    return w


@triton.jit
def _inputs(x_row, rk, mask, INS: tl.constexpr, ACT: tl.constexpr):
    """The row's inputs `rk` in its dtype: with `ACT` (1 SiLU, 2 GELU's tanh form) the row is a fused gate/up
    output, gate then up, `INS` each, and the inputs are act(gate) * up, rounded where
    runtime/kernels/gpu/elementwise.py's `_act_mul` rounds (the same bits as its launch)."""
    x = tl.load(x_row + rk, mask=mask, other=0.0)
    if ACT:
        up = tl.load(x_row + INS + rk, mask=mask, other=0.0)
        wide = x.to(tl.float32)
        if ACT == 2:
            inner = 0.7978845608028654 * (wide + 0.044715 * wide * wide * wide)
            act = (0.5 * wide * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))).to(x.dtype)
        else:
            act = (wide / (1.0 + tl.exp(-wide))).to(x.dtype)
        x = (act.to(tl.float32) * up.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _scales(d_ptr, m_ptr, ds_ptr, ms_ptr, rn, out_ok, g, d_stride, ds_stride, GROUPS: tl.constexpr,
            HAS_M: tl.constexpr, SUPER: tl.constexpr):
    """Group `g`'s (d, m) of outputs `rn`, float32 `[BLOCK_N]` (m is d again without `HAS_M`): a K-quant's
    its super-block's scale times the group's integer sub-scale (gguf's float32 product)."""
    ok = out_ok & (g < GROUPS)
    d = tl.load(d_ptr + rn * d_stride + g, mask=ok, other=0).to(tl.float32)
    if SUPER:
        supers = rn * ds_stride + g // SUPER
        d = tl.load(ds_ptr + supers, mask=ok, other=0.0) * d
    m = d
    if HAS_M:
        m = tl.load(m_ptr + rn * d_stride + g, mask=ok, other=0).to(tl.float32)
        if SUPER:
            m = tl.load(ms_ptr + supers, mask=ok, other=0.0) * m
    return d, m
