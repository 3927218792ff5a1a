"""Linear layers that read one input, run as one: `Projections` (q, k and v; gate and up) over a fused
layer whose weight the layers' own weights become views of (`fuse_linears`), and `rows_call`, a layer's
computation without a module call. Every kernel used computes an output column from its own weights
only, so the fused columns keep each layer's bits (runtime.model.decoder's lean forward uses them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.model.quantize import QuantizedLinear


class Projections:
    """Several linear layers that read the same input `[rows, in_features]`: one fused matmul split
    into their outputs, or (when the layers cannot be fused) one call each."""

    def __init__(self, layers: list[nn.Module], sizes: list[int] | None = None) -> None:
        """`sizes`: the outputs of one layer fused already (Phi-3's qkv_proj and gate_up_proj)."""
        self.sizes = sizes or [layer.out_features for layer in layers]
        self.layers = list(layers)
        self.fused = layers[0] if sizes else fuse_linears(layers)
        self.calls = [rows_call(layer) for layer in layers]
        self.fused_call = None if self.fused is None else rows_call(self.fused)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.fused_call is None:
            return tuple(call(x) for call in self.calls)
        return self.fused_call(x).split(self.sizes, dim=-1)

    def split_last(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(every output but the last side by side, the last output): a view of the fused output."""
        if self.fused_call is None:
            *rest, last = (call(x) for call in self.calls)
            return torch.cat(rest, dim=-1), last
        y = self.fused_call(x)
        width = y.shape[-1] - self.sizes[-1]
        return y[:, :width], y[:, width:]


def rows_call(layer: nn.Module):
    """The layer's computation for `[rows, in_features]` without a module call: transformers' bits."""
    if isinstance(layer, QuantizedLinear):
        return layer.rows
    if type(layer) is nn.Linear:
        return lambda x: F.linear(x, layer.weight, layer.bias)
    return layer


def fuse_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One layer computing `layers`' outputs side by side, the layers' weights becoming views of its
    weight; None when they are not all of one kind that can be fused."""
    kind = type(layers[0])
    if any(type(layer) is not kind or (layer.bias is None) != (layers[0].bias is None) for layer in layers):
        return None
    if kind is nn.Linear:
        first = layers[0].weight
        fused = nn.Linear(first.shape[1], sum(layer.out_features for layer in layers),
                          bias=layers[0].bias is not None, device=first.device, dtype=first.dtype)
        fused.weight = nn.Parameter(torch.cat([layer.weight.detach() for layer in layers]), requires_grad=False)
        if fused.bias is not None:
            fused.bias = nn.Parameter(torch.cat([layer.bias.detach() for layer in layers]), requires_grad=False)
        start = 0
        for layer in layers:
            rows = layer.out_features
            layer.weight = nn.Parameter(fused.weight[start:start + rows], requires_grad=False)
            start += rows
        return fused
    if issubclass(kind, QuantizedLinear) and hasattr(kind, "concatenated"):
        return kind.concatenated(layers)
    return None
