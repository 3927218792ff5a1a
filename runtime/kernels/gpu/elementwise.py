"""RMSNorm (with the residual add before it; llama's and Gemma's) and SiLU * mul (or GELU * mul) as Triton kernels.

The arithmetic is transformers' (LlamaRMSNorm, Gemma3RMSNorm, `act(gate) * up`),
computed in float32 and rounded to the activations' dtype where transformers rounds between
operators that change the result (the norm's output before the weight, silu's output before the
product); the rest is rounded once, so bfloat16 results are within one rounding of torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x_ptr, res_ptr, w_ptr, pre_ptr, out_ptr, res_out_ptr, n, x_stride, res_stride, out_stride, eps,
              pre_eps, HAS_RES: tl.constexpr, HAS_PRE: tl.constexpr, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0)
    if HAS_PRE:  # Gemma's norm of a sublayer's output before the add (an offset norm, its own eps)
        wide = x.to(tl.float32)
        scale = tl.load(pre_ptr + cols, mask=inside, other=0.0)
        x = (wide * tl.rsqrt(tl.sum(wide * wide, axis=0) / n + pre_eps) * scale).to(x.dtype)
    if HAS_RES:  # the stream after the add, in the activations' dtype (transformers adds there)
        added = tl.load(res_ptr + row * res_stride + cols, mask=inside, other=0.0)
        x = (x.to(tl.float32) + added.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * n + cols, x, mask=inside)
    wide = x.to(tl.float32)
    variance = tl.sum(wide * wide, axis=0) / n
    if OFFSET:  # Gemma's: x * rsqrt(mean(x^2) + eps) * (1 + w) in float32, rounded once; `w_ptr` holds 1 + w
        w = tl.load(w_ptr + cols, mask=inside, other=0.0)
        tl.store(out_ptr + row * out_stride + cols, (wide * tl.rsqrt(variance + eps) * w).to(x.dtype), mask=inside)
    else:  # llama's: the normed x rounded to the activations' dtype, then times w
        normed = (wide * tl.rsqrt(variance + eps)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0)
        tl.store(out_ptr + row * out_stride + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype),
                 mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             offset: bool = False, pre: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of `x + residual` (of `x` without one), `x + residual` (`x`)) for `x` `[rows, n]`
    (rows may be strided; elements contiguous). One program per row. `offset`: Gemma's norm, `weight`
    its float32 1 + w; `pre` (1 + w in float32, eps): `x` first normed by that offset norm (Gemma's
    post-attention and post-feedforward norms), with `residual`."""
    rows, n = x.shape
    assert pre is None or residual is not None
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else x
    if rows:
        _rms_norm[(rows,)](x, x if residual is None else residual, weight, weight if pre is None else pre[0], out,
                           summed, n, x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0), eps,
                           0.0 if pre is None else pre[1], HAS_RES=residual is not None, HAS_PRE=pre is not None,
                           OFFSET=offset, BLOCK=triton.next_power_of_2(n))
    return out, summed


@triton.jit
def _act_mul(x_ptr, out_ptr, n, x_stride, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    gate = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0)
    up = tl.load(x_ptr + row * x_stride + n + cols, mask=inside, other=0.0)
    wide = gate.to(tl.float32)
    if GELU:  # gelu's tanh form, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh(z) as 1 - 2 / (e^2z + 1)
        inner = 0.7978845608028654 * (wide + 0.044715 * wide * wide * wide)
        act = (0.5 * wide * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))).to(gate.dtype)
    else:
        act = (wide / (1.0 + tl.exp(-wide))).to(gate.dtype)
    tl.store(out_ptr + row * n + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=inside)


def act_mul(gate_up: torch.Tensor, width: int, gelu: bool = False) -> torch.Tensor:
    """silu(gate) * up (gelu's tanh form with `gelu`: Gemma's) for `gate_up` `[rows, 2 * width]` (gate,
    then up)."""
    rows = gate_up.shape[0]
    assert gate_up.shape[1] == 2 * width and gate_up.stride(1) == 1
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    if rows:
        _act_mul[(rows, triton.cdiv(width, block))](gate_up, out, width, gate_up.stride(0), GELU=gelu, BLOCK=block)
    return out
