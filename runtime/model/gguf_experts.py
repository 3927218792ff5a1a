"""A GGUF's routed experts (llama.cpp's `blk.N.ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`, three
dimensions `[experts, out, in]`) loaded tensor by tensor into one kernel layer per expert
(runtime.model.experts.KernelExperts), an expert's slab of the file's blocks at a time: no float copy of
a stacked tensor is ever made. The router (`ffn_gate_inp`) is loaded as transformers loads it and then
runs in ponder's float kernel (`KernelRouter`).

transformers' GGUF name map sends `ffn_gate_exps` and `ffn_up_exps` both to the experts' `gate_up_proj`
(gate rows first) and `ffn_down_exps` to `down_proj`; `ExpertTensors` takes the tensors so mapped.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from torch import nn

from runtime.model.experts import KernelExperts, KernelRouter, RoutedMLP, renormalises
from runtime.model.float_layers import FloatLinear, narrowest
from runtime.model.loader import CheckpointMismatch
from runtime.model.quantize import QuantizedLinear

_PARTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}


class ExpertTensors:
    """The stacked expert tensors of a model being loaded, held as kernel layers until a block's three
    have come (`take`), then put in place with its router (`finish`)."""

    def __init__(self, model: nn.Module) -> None:
        self.blocks = {name: module for name, module in model.named_modules() if RoutedMLP.takes(module)}
        self.layers: dict[str, dict[str, list[QuantizedLinear]]] = {}

    def owner(self, tensor_name: str, target: str) -> str | None:
        """The routed block whose experts `target` (the model's name for the file's tensor) belongs to."""
        block_name = target.rpartition(".experts.")[0]
        part = tensor_name.rsplit(".", 2)[-2] if tensor_name.count(".") >= 2 else ""
        return block_name if block_name in self.blocks and part in _PARTS else None

    def take(self, block_name: str, tensor_name: str, raw: np.ndarray,
             make: Callable[[np.ndarray, tuple[int, int]], QuantizedLinear]) -> None:
        """Make `raw` [experts, out, bytes] (the file's blocks) one layer an expert with `make`."""
        experts = self.blocks[block_name].experts
        part = _PARTS[tensor_name.rsplit(".", 2)[-2]]
        rows, cols = ((experts.down_proj.shape[1], experts.down_proj.shape[2]) if part == "down" else
                      (experts.gate_up_proj.shape[1] // 2, experts.gate_up_proj.shape[2]))
        if raw.shape[0] != experts.num_experts:
            raise CheckpointMismatch(f"{tensor_name} holds {raw.shape[0]} experts, the model wants {experts.num_experts}")
        self.layers.setdefault(block_name, {})[part] = [make(raw[e], (rows, cols)) for e in range(raw.shape[0])]

    def finish(self) -> int:
        """Put every block's experts and router in place; returns how many expert layers were made.
        Raises CheckpointMismatch for a block the file did not give all three tensors of."""
        made = 0
        for block_name, block in self.blocks.items():
            parts = self.layers.get(block_name, {})
            if set(parts) != {"gate", "up", "down"}:
                raise CheckpointMismatch(f"{block_name}: the file lacks its experts' "
                                         f"{', '.join(sorted({'gate', 'up', 'down'} - set(parts)))} tensor(s)")
            gate_up = [type(g).concatenated([g, u]) for g, u in zip(parts["gate"], parts["up"])]
            if any(layer is None for layer in gate_up):
                raise CheckpointMismatch(f"{block_name}: its experts' gate and up layers cannot be computed side by side")
            block.experts = KernelExperts(gate_up, parts["down"], block.experts.act_fn)
            router = block.gate
            block.gate = KernelRouter(FloatLinear.from_weight(narrowest(router.weight.detach())), router.top_k,
                                      renormalises(router))
            made += 3 * len(gate_up)
        return made
