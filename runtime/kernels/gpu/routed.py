"""A routed MLP block's experts (Qwen3-MoE's, Qwen3.5-MoE's: SiLU(gate) * up, then down) over a GGUF's
own blocks stacked an expert a slice, in two Triton launches whatever the batch and the experts hit:

1. `_gate_up`: a program per (token's expert, block of `BLOCK_N` inner columns) computes that expert's
   gate and up outputs of those columns over the token's row and stores SiLU(gate) * up;
2. `_down`: a program per (token, block of outputs) computes each of the token's experts' down
   outputs in ascending expert order, scales each by its routing weight and sums them in float32
   from zero (what runtime.model.experts.mix_experts adds, in that order), stored once.

Every product is runtime/kernels/gpu/linear.py's `_dot` (the same codes, scales and float32 chunk
sums as a `block_linear` of the expert's layer with the same tile of one row a program), and no program reads another
token's row: a token's outputs are the same bits alone as in any batch. Nothing waits for the host
(no per-expert counts read back, as the per-expert loop must).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runtime.kernels.gpu import linear
from runtime.kernels.gpu.linear import _dot


@dataclass
class StackedBlocks:
    """Every expert's blocks of one layer kind, expert e's at `[e]`: `codes` `[experts, out, in or in / 2]`,
    `d` (and `m`) `[experts, out, groups]` float32, or int8 sub-scales with float32 super-block scales
    `d_super` (and `m_super`) `[experts, out, in / 256]`; packed 6-bit codes' two high bits `high`
    `[experts, out, in / 4]`, the codes less `offset` (runtime.model.gpu_blocks' forms)."""

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    packed: bool
    d_super: torch.Tensor | None = None
    m_super: torch.Tensor | None = None
    high: torch.Tensor | None = None
    offset: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        """An expert's (outputs, inputs)."""
        return self.codes.shape[1], self.codes.shape[2] * (2 if self.packed else 1)

    def launch_args(self) -> tuple[list, dict]:
        """The kernel's pointers and strides for these blocks, and its constants (`_dot`'s) with the tile
        of an expert's layer shape at one row (runtime.kernels.gpu.linear's `tile_for`; its sizes only)."""
        outs, ins = self.shape
        d, ds = self.d, self.d_super
        block_n, block_k, warps, *_ = linear.tile_for((outs, ins, self.packed), 1)
        group = ins // d.shape[2]
        block_k = max(block_k, group)
        ms, high = self.m_super, self.high
        pointers = [self.codes, self.codes if high is None else high, d, d if self.m is None else self.m,
                    d if ds is None else ds, d if ms is None else ms,
                    self.codes.stride(0), 0 if high is None else high.stride(0), d.stride(0),
                    0 if ds is None else ds.stride(0), self.codes.stride(1), 0 if high is None else high.stride(1),
                    d.stride(1), 0 if ds is None else ds.stride(1)]
        constants = dict(INS=ins, GROUP=group, BLOCKS=True, HAS_M=self.m is not None,
                         SUPER=0 if ds is None else d.shape[2] // ds.shape[2], PACKED=self.packed,
                         HIGH=high is not None, OFFSET=self.offset, BLOCK_N=block_n, BLOCK_K=block_k,
                         CHUNK=triton.cdiv(ins, block_k) * block_k, num_warps=warps)
        return pointers, constants


@triton.jit
def _gate_up(x_ptr, experts_ptr, h_ptr, w_ptr, t_ptr, d_ptr, m_ptr, ds_ptr, ms_ptr, w_expert, t_expert, d_expert,
             ds_expert, w_stride, t_stride, d_stride, ds_stride, inner, x_stride, TOP_K: tl.constexpr,
             INS: tl.constexpr, GROUP: tl.constexpr, BLOCKS: tl.constexpr, HAS_M: tl.constexpr, SUPER: tl.constexpr,
             PACKED: tl.constexpr, HIGH: tl.constexpr, OFFSET: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):
    entry = tl.program_id(0)  # token entry // TOP_K's (entry % TOP_K)-th expert
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rn < inner
    e = tl.load(experts_ptr + entry).to(tl.int64)
    x_row = x_ptr + (entry // TOP_K) * x_stride
    w, t, d, ds = w_ptr + e * w_expert, t_ptr + e * t_expert, d_ptr + e * d_expert, ds_ptr + e * ds_expert
    m, ms = m_ptr + e * d_expert, ms_ptr + e * ds_expert
    gate = _dot(x_row, w, t, d, m, ds, ms, rn, ok, 0, w_stride, t_stride, d_stride, ds_stride, INS, GROUP, BLOCKS,
                HAS_M, SUPER, PACKED, HIGH, OFFSET, BLOCK_N, BLOCK_K, CHUNK)
    up = _dot(x_row, w, t, d, m, ds, ms, rn + inner, ok, 0, w_stride, t_stride, d_stride, ds_stride, INS, GROUP,
              BLOCKS, HAS_M, SUPER, PACKED, HIGH, OFFSET, BLOCK_N, BLOCK_K, CHUNK)
    h = gate / (1.0 + tl.exp(-gate)) * up  # SiLU(gate) * up
    tl.store(h_ptr + entry * inner + rn, h.to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _down(h_ptr, experts_ptr, weights_ptr, out_ptr, w_ptr, t_ptr, d_ptr, m_ptr, ds_ptr, ms_ptr, w_expert, t_expert,
          d_expert, ds_expert, w_stride, t_stride, d_stride, ds_stride, outs, TOP_K: tl.constexpr, INS: tl.constexpr,
          GROUP: tl.constexpr, BLOCKS: tl.constexpr, HAS_M: tl.constexpr, SUPER: tl.constexpr, PACKED: tl.constexpr,
          HIGH: tl.constexpr, OFFSET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          CHUNK: tl.constexpr):
    token = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rn < outs
    total = tl.zeros((BLOCK_N,), tl.float32)
    for k in tl.static_range(TOP_K):  # (the token's experts in ascending order: one order whatever the batch)
        entry = token * TOP_K + k
        e = tl.load(experts_ptr + entry).to(tl.int64)
        weight = tl.load(weights_ptr + entry).to(tl.float32)
        part = _dot(h_ptr + entry * INS, w_ptr + e * w_expert, t_ptr + e * t_expert, d_ptr + e * d_expert,
                    m_ptr + e * d_expert, ds_ptr + e * ds_expert, ms_ptr + e * ds_expert, rn, ok, 0, w_stride,
                    t_stride, d_stride, ds_stride, INS, GROUP, BLOCKS, HAS_M, SUPER, PACKED, HIGH, OFFSET, BLOCK_N,
                    BLOCK_K, CHUNK)
        total += part * weight
    tl.store(out_ptr + token * outs + rn, total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _route(logits_ptr, experts_ptr, weights_ptr, num_experts, logits_stride, TOP_K: tl.constexpr,
           RENORMALISE: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    ids = tl.arange(0, BLOCK)
    inside = ids < num_experts
    logits = tl.load(logits_ptr + token * logits_stride + ids, mask=inside, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)  # the softmax over every expert, in float32
    left = tl.where(inside, p, -1.0)
    chosen = ids < 0
    total = 0.0
    for k in tl.static_range(TOP_K):  # the largest k, the lowest id first among equals (torch.topk leaves it open)
        best = tl.max(left, axis=0)
        first = tl.min(tl.where(left == best, ids, BLOCK), axis=0)
        chosen = chosen | (ids == first)
        left = tl.where(ids == first, -1.0, left)
        total += best
    weights = p / total if RENORMALISE else p
    place = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # the chosen in ascending expert order
    tl.store(experts_ptr + token * TOP_K + place, ids, mask=chosen)
    tl.store(weights_ptr + token * TOP_K + place, weights.to(weights_ptr.dtype.element_ty), mask=chosen)


def route_rows(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts int32, weights in the logits' dtype) `[tokens, top_k]`, each row's in ascending expert
    order: a softmax over every expert in float32, its top k (renormalised to sum to 1 where
    `renormalise`), as runtime.model.experts.route computes them (Qwen3-MoE's router), in one launch
    a row of its own."""
    tokens, num_experts = logits.shape
    experts = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((tokens, top_k), dtype=logits.dtype, device=logits.device)
    if tokens:
        _route[(tokens,)](logits, experts, weights, num_experts, logits.stride(0), TOP_K=top_k,
                          RENORMALISE=renormalise, BLOCK=triton.next_power_of_2(num_experts))
    return experts, weights


def routed_mlp(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, gate_up: StackedBlocks,
               down: StackedBlocks, ascending: bool = False) -> torch.Tensor:
    """Sum over each row of `x` `[tokens, hidden]` of its experts' weight * down(SiLU(gate) * up) (`indices`,
    `weights` `[tokens, top_k]`: a router's; `ascending`: each row's experts in ascending order already,
    int32, as `route_rows` gives them), `gate_up`'s outputs the gate's inner columns then the up's."""
    tokens, top_k = indices.shape
    (inner2, hidden), (outs, inner) = gate_up.shape, down.shape
    assert inner2 == 2 * inner and outs == hidden == x.shape[1] and x.stride(1) == 1
    out = torch.empty((tokens, outs), dtype=x.dtype, device=x.device)
    if not tokens:
        return out
    if ascending:
        experts, entry_weights = indices, weights
    else:
        experts, order = indices.sort(dim=-1)  # (a row's experts in ascending order, as mix_experts adds them)
        experts = experts.to(torch.int32).contiguous()
        entry_weights = weights.gather(-1, order).contiguous()
    h = torch.empty((tokens * top_k, inner), dtype=x.dtype, device=x.device)
    pointers, constants = gate_up.launch_args()
    grid = (tokens * top_k, triton.cdiv(inner, constants["BLOCK_N"]))
    _gate_up[grid](x, experts, h, *pointers, inner, x.stride(0), TOP_K=top_k, **constants)
    pointers, constants = down.launch_args()
    _down[(tokens, triton.cdiv(outs, constants["BLOCK_N"]))](h, experts, entry_weights, out, *pointers, outs,
                                                           TOP_K=top_k, **constants)
    return out
