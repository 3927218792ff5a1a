"""A linear layer as a Triton GEMM with a fixed reduction order, over float weights or over a GGUF's own
blocks as runtime.model.gguf_blocks keeps them (w = d * q + m per group of input features).

Each program computes a tile of outputs, summing over the input features in chunks of `BLOCK_K` in
order, with tile sizes that never depend on the number of rows: a row's outputs are the same bits
whatever the other rows (batch invariance by construction, as the CPU kernels are), the way Thinking
Machines' and SGLang's batch-invariant GEMMs keep it. The weights are dequantized in registers from the
file's codes and scales (no re-quantization; what `gguf.dequantize` computes, tested), and the products
summed in float32 (IEEE, not TF32).

Not wired into a model yet: the runner's GPU path calls torch's matmuls (row padding keeps their rows
their own); this is the kernel a GPU's `quantize = "auto"` and an invariant linear path would call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32  # fixed whatever the shapes: the reduction order never changes


@triton.jit
def _linear(x_ptr, w_ptr, d_ptr, m_ptr, out_ptr, rows, outs, x_stride, w_stride, d_stride, out_stride,
            INS: tl.constexpr, GROUP: tl.constexpr, BLOCKS: tl.constexpr, HAS_M: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, out_ok = rm < rows, rn < outs
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, INS, BLOCK_K):  # (the width a constant: one compiled kernel per layer shape)
        rk = k0 + tl.arange(0, BLOCK_K)
        in_ok = rk < INS
        x = tl.load(x_ptr + rm[:, None] * x_stride + rk[None, :], mask=row_ok[:, None] & in_ok[None, :],
                    other=0.0).to(tl.float32)
        tile_ok = out_ok[:, None] & in_ok[None, :]
        w = tl.load(w_ptr + rn[:, None] * w_stride + rk[None, :], mask=tile_ok, other=0).to(tl.float32)
        if BLOCKS:  # codes -> weights: d * q (+ m), one (d, m) per GROUP input features
            group = rn[:, None] * d_stride + rk[None, :] // GROUP
            w = w * tl.load(d_ptr + group, mask=tile_ok, other=0.0)
            if HAS_M:
                w = w + tl.load(m_ptr + group, mask=tile_ok, other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    tl.store(out_ptr + rm[:, None] * out_stride + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & out_ok[None, :])


def _launch(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor | None, m: torch.Tensor | None) -> torch.Tensor:
    rows, ins = x.shape
    outs = w.shape[0]
    assert w.shape[1] == ins and x.stride(1) == 1 and w.stride(1) == 1
    out = torch.empty((rows, outs), dtype=x.dtype, device=x.device)
    group = ins // d.shape[1] if d is not None else 1
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(outs, BLOCK_N))
    if rows:
        _linear[grid](x, w, w if d is None else d, w if m is None else m, out, rows, outs, x.stride(0),
                      w.stride(0), 0 if d is None else d.stride(0), out.stride(0), INS=ins, GROUP=group,
                      BLOCKS=d is not None, HAS_M=m is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x `[rows, in]` @ weight `[out, in]`.T, each row's outputs its own bits whatever the rows."""
    return _launch(x, weight, None, None)


def block_linear(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """x `[rows, in]` times the weights `d * codes + m` (`codes` `[out, in]` int8 or uint8, `d` and `m`
    `[out, groups]` float32, runtime.model.gguf_blocks.Blocks), transposed; dequantized in registers."""
    assert codes.shape[1] % d.shape[1] == 0 and (m is None or m.shape == d.shape)
    return _launch(x, codes, d.float().contiguous(), None if m is None else m.float().contiguous())
