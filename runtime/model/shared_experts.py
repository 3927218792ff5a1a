"""Qwen3.5-MoE's sparse MLP block (transformers' `Qwen3_5MoeSparseMoeBlock`) in the lean decoder: the routed
experts (runtime.model.experts.RoutedMLP) beside a shared expert whose output a one-column gate scales,
transformers' arithmetic in its order on the normed rows `x`:

    shared = down(act(gate(x)) * up(x))                  (the shared expert: llama's MLP, gate and up fused)
    routed = RoutedMLP(x)                                (its router's top-k, the experts' weighted sum)
    out    = routed + sigmoid(shared_gate(x)) * shared

Each linear is computed as its own layer computes it (`rows_call`; gate and up as one fused layer whose
columns keep their bits), so the block's output is transformers' forward's where RoutedMLP's is."""

from __future__ import annotations

import torch
from torch import nn

from runtime.model.experts import RoutedMLP
from runtime.model.projections import Projections, rows_call

SHARED_EXPERT_BLOCKS = ("Qwen3_5MoeSparseMoeBlock",)


class SharedExpertMoE:
    """See the module docstring."""

    def __init__(self, mlp: nn.Module) -> None:
        self.routed = RoutedMLP(mlp)
        shared = mlp.shared_expert
        self.gate_up = Projections([shared.gate_proj, shared.up_proj])
        self.act = shared.act_fn
        self.down = rows_call(shared.down_proj)
        self.shared_gate = rows_call(mlp.shared_expert_gate)

    @staticmethod
    def takes(mlp: nn.Module) -> bool:
        shared = getattr(mlp, "shared_expert", None)
        return type(mlp).__name__ in SHARED_EXPERT_BLOCKS and RoutedMLP.takes(mlp) and \
            getattr(mlp, "shared_expert_gate", None) is not None and shared is not None and \
            all(hasattr(shared, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        shared = self.down(self.act(gate) * up)
        routed = self.routed(x)
        return routed + torch.sigmoid(self.shared_gate(x)) * shared
