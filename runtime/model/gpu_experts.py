"""A GGUF's routed experts on a GPU, the file's blocks kept (runtime.model.gguf_experts with a device):
each expert's layers are `GpuBlockLinear`s whose buffers are views of one stack a layer kind
(`StackedBlocks`: codes `[experts, out, ...]`, scales likewise), and the block's experts run in two
Triton launches (runtime/kernels/gpu/routed.py) where they compute SiLU(gate) * up (Qwen3-MoE's,
Qwen3.5-MoE's) and every expert's gate/up, and every expert's down, is of one form. Otherwise (gpt-oss's
biased, clamped experts; a file whose experts' gate and up differ in type) the experts run as the CPU's
do, one block GEMM a layer an expert hit (runtime.model.experts.mix_experts). Either way a token's
outputs are its own bits whatever the batch.

The router's float weights run in the Triton float GEMV (`GpuFloatLinear`), batch-invariant too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from runtime.model.experts import SILU, KernelExperts, SiluGLU
from runtime.model.gpu_blocks import SCALES, GpuBlockLinear
from runtime.model.quantize import QuantizedLinear

if TYPE_CHECKING:  # (the kernels' module imports Triton: only where a GPU layer runs)
    from runtime.kernels.gpu.routed import StackedBlocks


def stack(experts: list[list[GpuBlockLinear]]) -> tuple[StackedBlocks, list[GpuBlockLinear]] | None:
    """Every expert's layers `experts[e]` (one kind's, as [down], or two side by side, as [gate, up]) as one
    `StackedBlocks` and a layer an expert over its slice; each given layer's buffers become views of
    the stack as it is copied in, so stacking needs one expert's room beyond the stack, not a second
    copy. None where the layers differ in form or shape, or one has a bias."""
    from runtime.kernels.gpu.routed import StackedBlocks

    layers = [layer for parts in experts for layer in parts]
    if not all(type(layer) is GpuBlockLinear and layer.bias is None for layer in layers) or \
            len({layer.form for layer in layers}) != 1 or \
            len({tuple(tuple(layer.weight.shape) for layer in parts) for parts in experts}) != 1:
        return None
    whole: dict[str, torch.Tensor | None] = {}
    for name in SCALES:
        first = getattr(layers[0], name)
        rows = sum(getattr(layer, name).shape[0] for layer in experts[0]) if first is not None else 0
        whole[name] = None if first is None else \
            torch.empty((len(experts), rows, *first.shape[1:]), dtype=first.dtype, device=first.device)
    fused = []
    for e, parts in enumerate(experts):
        for name, tensor in whole.items():
            start = 0
            for layer in parts if tensor is not None else ():
                rows = getattr(layer, name).shape[0]
                tensor[e, start:start + rows] = getattr(layer, name)
                setattr(layer, name, tensor[e, start:start + rows])  # (the layer's own copy freed)
                start += rows
        of = {name: None if tensor is None else tensor[e] for name, tensor in whole.items()}
        fused.append(parts[0] if len(parts) == 1 else GpuBlockLinear(
            of["weight"], of["d"], of["m"], parts[0].packed, d_super=of["d_super"], m_super=of["m_super"],
            high=of["high"], offset=parts[0].offset))
    blocks = StackedBlocks(whole["weight"], whole["d"], whole["m"], layers[0].packed, whole["d_super"], whole["m_super"],
                           whole["high"], layers[0].offset)
    return blocks, fused


class GpuExperts(KernelExperts):
    """`KernelExperts` over `GpuBlockLinear` layers, run by the routed Triton kernels where `stacks`
    ((gate/up's, down's) `StackedBlocks`, the layers' buffers views of them) is given and they compute
    SiLU(gate) * up; else by the per-expert loop."""

    def __init__(self, gate_up: list, down: list, act_fn: nn.Module | None, glu=None, stacks=None) -> None:
        super().__init__(gate_up, down, act_fn, glu)
        silu = isinstance(self.glu, SiluGLU) and type(self.glu.act) in SILU
        self.stacks = stacks if silu else None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.stacks is None:
            return super().forward(hidden_states, top_k_index, top_k_weights)
        from runtime.kernels.gpu.routed import routed_mlp

        return routed_mlp(hidden_states.contiguous(), top_k_index, top_k_weights, *self.stacks)

    @property
    def nbytes(self) -> int:
        """Bytes of every expert's codes and scales."""
        return sum(layer.nbytes for layer in [*self.gate_up, *self.down])


def gpu_experts(gate: list, up: list, down: list, act_fn: nn.Module | None, glu=None) -> GpuExperts:
    """A block's experts from each expert's gate, up and down `GpuBlockLinear` on the device: stacked for
    the routed kernels where every gate and up, and every down, is of one form; else each expert's gate
    and up side by side (`GpuBlockLinear.concatenated`) for the per-expert loop."""
    gate_up, downs = stack([[g, u] for g, u in zip(gate, up)]), stack([[d] for d in down])
    if gate_up is None or downs is None:
        return GpuExperts([type(g).concatenated([g, u]) for g, u in zip(gate, up)], down, act_fn, glu)
    return GpuExperts(gate_up[1], downs[1], act_fn, glu, stacks=(gate_up[0], downs[0]))


class GpuFloatLinear(QuantizedLinear):
    """Float weights `[out, in]` in the Triton float GEMV (runtime/kernels/gpu/linear.py): each row's outputs
    its own bits whatever the rows (a router's logits, so its routing too)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.contiguous())
        self.bias = bias

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        from runtime.kernels.gpu.linear import linear

        y = linear(x.contiguous(), self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantized(self) -> torch.Tensor:
        return self.weight.float()
