"""A linear layer as a Triton GEMM with a fixed reduction order, over float weights or over a GGUF's own
blocks as runtime.model.gguf_blocks keeps them (w = d * q + m per group of input features).

Each program computes `BLOCK_N` outputs of one row (a GEMV: decode steps have few rows), summing over
the input features in chunks of `BLOCK_K` in order, with sizes that never depend on the number of
rows: a row's outputs are the same bits whatever the other rows (batch invariance by construction, as
the CPU kernels are). The weights are dequantized in registers from the file's codes and scales (no
re-quantization; what `gguf.dequantize` computes, tested), and the products summed in float32 on the
CUDA cores (no tensor cores: rows of a step read the same weight tile, mostly from L2).

Not wired into a model yet: the runner's GPU path calls torch's matmuls (row padding keeps their rows
their own); this is the kernel a GPU's `quantize = "auto"` and an invariant linear path would call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N, BLOCK_K = 32, 128  # fixed whatever the shapes: the reduction order never changes


@triton.jit
def _linear(x_ptr, w_ptr, d_ptr, m_ptr, out_ptr, outs, x_stride, w_stride, d_stride, out_stride,
            INS: tl.constexpr, GROUP: tl.constexpr, BLOCKS: tl.constexpr, HAS_M: tl.constexpr,
            PACKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = rn < outs
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, INS, BLOCK_K):  # (the width a constant: one compiled kernel per layer shape)
        rk = k0 + tl.arange(0, BLOCK_K)
        in_ok = rk < INS
        x = tl.load(x_ptr + row * x_stride + rk, mask=in_ok, other=0.0).to(tl.float32)
        tile_ok = out_ok[:, None] & in_ok[None, :]
        if PACKED:  # two 4-bit codes a byte, input 2i in the low half, 2i + 1 in the high
            byte = tl.load(w_ptr + rn[:, None] * w_stride + rk[None, :] // 2, mask=tile_ok, other=0)
            w = ((byte >> ((rk[None, :] % 2) * 4).to(tl.uint8)) & 15).to(tl.float32)
        else:
            w = tl.load(w_ptr + rn[:, None] * w_stride + rk[None, :], mask=tile_ok, other=0).to(tl.float32)
        if BLOCKS:  # codes -> weights: d * q (+ m), one (d, m) per GROUP input features
            group = rn[:, None] * d_stride + rk[None, :] // GROUP
            w = w * tl.load(d_ptr + group, mask=tile_ok, other=0.0)
            if HAS_M:
                w = w + tl.load(m_ptr + group, mask=tile_ok, other=0.0)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + row * out_stride + rn, acc.to(out_ptr.dtype.element_ty), mask=out_ok)


def _launch(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor | None, m: torch.Tensor | None,
            packed: bool = False) -> torch.Tensor:
    rows, ins = x.shape
    outs = w.shape[0]
    assert w.shape[1] * (2 if packed else 1) == ins and x.stride(1) == 1 and w.stride(1) == 1
    out = torch.empty((rows, outs), dtype=x.dtype, device=x.device)
    group = ins // d.shape[1] if d is not None else 1
    grid = (rows, triton.cdiv(outs, BLOCK_N))
    if rows:
        _linear[grid](x, w, w if d is None else d, w if m is None else m, out, outs, x.stride(0),
                      w.stride(0), 0 if d is None else d.stride(0), out.stride(0), INS=ins, GROUP=group,
                      BLOCKS=d is not None, HAS_M=m is not None, PACKED=packed, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x `[rows, in]` @ weight `[out, in]`.T, each row's outputs its own bits whatever the rows."""
    return _launch(x, weight, None, None)


def block_linear(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                 packed: bool = False) -> torch.Tensor:
    """x `[rows, in]` times the weights `d * codes + m` (`codes` `[out, in]` int8 or uint8, `d` and `m`
    `[out, groups]` float32, runtime.model.gguf_blocks.Blocks), transposed; dequantized in registers.
    `packed`: `codes` `[out, in / 2]` holds two 4-bit codes a byte (`pack_nibbles`)."""
    width = codes.shape[1] * (2 if packed else 1)
    assert width % d.shape[1] == 0 and (m is None or m.shape == d.shape)
    return _launch(x, codes, d.float().contiguous(), None if m is None else m.float().contiguous(), packed)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes `[out, in]` (uint8, 0..15) as `[out, in / 2]` bytes: input 2i low, 2i + 1 high."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)
