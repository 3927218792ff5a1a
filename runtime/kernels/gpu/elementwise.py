"""RMSNorm (with the residual add before it) and SiLU * mul as Triton kernels.

The arithmetic is transformers' (LlamaRMSNorm, `silu(gate) * up`),
computed in float32 and rounded to the activations' dtype where transformers rounds between
operators that change the result (the norm's output before the weight, silu's output before the
product); the rest is rounded once, so bfloat16 results are within one rounding of torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n, x_stride, res_stride, out_stride, eps,
              HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0)
    if HAS_RES:  # the stream after the add, in the activations' dtype (transformers adds there)
        added = tl.load(res_ptr + row * res_stride + cols, mask=inside, other=0.0)
        x = (x.to(tl.float32) + added.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * n + cols, x, mask=inside)
    wide = x.to(tl.float32)
    variance = tl.sum(wide * wide, axis=0) / n
    normed = (wide * tl.rsqrt(variance + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0)
    tl.store(out_ptr + row * out_stride + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of `x + residual` (of `x` without one), `x + residual` (`x`)) for `x` `[rows, n]`
    (rows may be strided; elements contiguous). One program per row."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else x
    if rows:
        _rms_norm[(rows,)](x, x if residual is None else residual, weight, out, summed, n, x.stride(0),
                           0 if residual is None else residual.stride(0), out.stride(0), eps,
                           HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n))
    return out, summed


@triton.jit
def _silu_mul(x_ptr, out_ptr, n, x_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    gate = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0)
    up = tl.load(x_ptr + row * x_stride + n + cols, mask=inside, other=0.0)
    wide = gate.to(tl.float32)
    act = (wide / (1.0 + tl.exp(-wide))).to(gate.dtype)
    tl.store(out_ptr + row * n + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=inside)


def silu_mul(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """silu(gate) * up for `gate_up` `[rows, 2 * width]` (gate, then up)."""
    rows = gate_up.shape[0]
    assert gate_up.shape[1] == 2 * width and gate_up.stride(1) == 1
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    if rows:
        _silu_mul[(rows, triton.cdiv(width, block))](gate_up, out, width, gate_up.stride(0), BLOCK=block)
    return out
