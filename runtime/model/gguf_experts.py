"""A GGUF's routed experts (llama.cpp's `blk.N.ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`, three
dimensions `[experts, out, in]`) loaded tensor by tensor into one kernel layer per expert
(runtime.model.experts.KernelExperts), an expert's slab of the file's blocks at a time: no float copy of
a stacked tensor is ever made. The router (`ffn_gate_inp`) is loaded as transformers loads it and then
runs in ponder's float kernel (`KernelRouter`).

transformers' GGUF name map sends `ffn_gate_exps` and `ffn_up_exps` both to the experts' `gate_up_proj`
(gate rows first) and `ffn_down_exps` to `down_proj`; `ExpertTensors` takes the tensors so mapped. gpt-oss's experts (biased,
transposed, their gate and up interleaved in transformers' model) are `GptOssExpertTensors`';
`expert_tensors(model)` says which a model's are.

On a GPU (`expert_tensors(model, device)`) each expert's layers are `GpuBlockLinear`s on the device and
a block's are stacked for the routed Triton kernels (runtime.model.gpu_experts), the router in the
Triton float GEMV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from runtime.model import gguf_gpt_oss
from runtime.model.experts import (ClampedSwiGLU, KernelExperts, KernelRouter, RoutedMLP, Routing, int4_routing,
                                   renormalises)
from runtime.model.float_layers import FloatLinear, narrowest
from runtime.model.gpu_experts import GpuFloatLinear, gpu_experts
from runtime.model.loader import CheckpointMismatch
from runtime.model.quantize import QuantizedLinear

_PARTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}


class ExpertTensors:
    """The stacked expert tensors of a model being loaded, held as kernel layers until a block's three
    have come (`take`), then put in place with its router (`finish`)."""

    def __init__(self, model: nn.Module, device: torch.device | None = None) -> None:
        self.blocks = {name: module for name, module in model.named_modules() if RoutedMLP.takes(module)}
        self.layers: dict[str, dict[str, list[QuantizedLinear]]] = {}
        self.device = device  # a GPU's (runtime.model.gpu_experts), or None: the CPU kernels'

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
        if raw.shape[0] != experts.num_experts:
            raise CheckpointMismatch(f"{tensor_name} holds {raw.shape[0]} experts, the model wants {experts.num_experts}")
        shape = self.shape(experts, part)
        self.layers.setdefault(block_name, {})[part] = [make(raw[e], shape) for e in range(raw.shape[0])]

    @staticmethod
    def shape(experts: nn.Module, part: str) -> tuple[int, int]:
        """An expert's (out, in) for `part` ("gate", "up" or "down") of transformers' stacked `experts`."""
        if part == "down":
            return experts.down_proj.shape[1], experts.down_proj.shape[2]
        return experts.gate_up_proj.shape[1] // 2, experts.gate_up_proj.shape[2]

    def take_bias(self, block_name: str, tensor_name: str, values) -> None:
        """A stacked bias of the experts: the model's (Qwen3-MoE's) have none."""
        raise CheckpointMismatch(f"{tensor_name}: {block_name}'s experts have no bias")

    def finish(self) -> int:
        """Put every block's experts and router in place; returns how many expert layers were made.
        Raises CheckpointMismatch for a block the file did not give all three tensors of."""
        made = 0
        for block_name, block in self.blocks.items():
            parts = self.layers.get(block_name, {})
            if set(parts) != {"gate", "up", "down"}:
                raise CheckpointMismatch(f"{block_name}: the file lacks its experts' "
                                         f"{', '.join(sorted({'gate', 'up', 'down'} - set(parts)))} tensor(s)")
            block.experts = self.experts(block_name, parts, block.experts.act_fn)
            router = block.gate
            routing = int4_routing(Routing(router.top_k, renormalises(router)), block.experts)
            block.gate = KernelRouter(self.router_layer(router.weight.detach()), router.top_k, renormalises(router),
                                      routing)
            made += 3 * len(parts["down"])
            del self.layers[block_name]  # (a GPU's stacks hold them now)
        return made

    def experts(self, block_name: str, parts: dict[str, list], act_fn: nn.Module | None, glu=None) -> KernelExperts:
        """A block's experts from each expert's gate, up and down layers: on a GPU stacked for the routed
        kernels where they can be (runtime.model.gpu_experts), else each expert's gate and up side by side."""
        if self.device is not None:
            return gpu_experts(parts["gate"], parts["up"], parts["down"], act_fn, glu)
        gate_up = [type(g).concatenated([g, u]) for g, u in zip(parts["gate"], parts["up"])]
        if any(layer is None for layer in gate_up):
            raise CheckpointMismatch(f"{block_name}: its experts' gate and up layers cannot be computed side by side")
        return KernelExperts(gate_up, parts["down"], act_fn, glu)

    def router_layer(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> QuantizedLinear:
        """The router's float weights in ponder's float kernel (a GPU's: the Triton float GEMV)."""
        if self.device is not None:
            return GpuFloatLinear(weight, bias)
        return FloatLinear.from_weight(narrowest(weight), bias)


@dataclass(frozen=True)
class HalvesClampedSwiGLU(ClampedSwiGLU):
    """`ClampedSwiGLU` over the gate's outputs then the up's (a file's experts) instead of interleaved: the
    same operators on the same elements."""

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        half = gate_up.shape[-1] // 2
        gate = gate_up[..., :half].clamp(min=None, max=self.limit)
        up = gate_up[..., half:].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssExpertTensors(ExpertTensors):
    """gpt-oss's stacked expert tensors (runtime.model.gguf_gpt_oss: the gate's and the up's `[experts, I,
    hidden]`, the down's `[experts, hidden, I]`) and their biases `[experts, out]` as kernel layers: an
    expert's gate and up one layer side by side (gate rows first, their biases so), read by
    `HalvesClampedSwiGLU`; the router with its bias in ponder's float kernel, top-k then softmax."""

    def __init__(self, model: nn.Module, device: torch.device | None = None) -> None:
        super().__init__(model, device)
        self.biases: dict[str, dict[str, torch.Tensor]] = {}

    @staticmethod
    def shape(experts: nn.Module, part: str) -> tuple[int, int]:
        hidden, width = experts.hidden_size, experts.intermediate_size
        return (hidden, width) if part == "down" else (width, hidden)

    def take_bias(self, block_name: str, tensor_name: str, values: np.ndarray) -> None:
        """A stacked bias `[experts, out]` (float values)."""
        experts = self.blocks[block_name].experts
        part = _PARTS[tensor_name.rsplit(".", 2)[-2]]
        width = experts.hidden_size if part == "down" else experts.intermediate_size
        if values.shape != (experts.num_experts, width):
            raise CheckpointMismatch(f"{tensor_name} is {values.shape}, the model wants {(experts.num_experts, width)}")
        dtype = experts.down_proj_bias.dtype
        self.biases.setdefault(block_name, {})[part] = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)

    def finish(self) -> int:
        made = 0
        for block_name, block in self.blocks.items():
            parts, biases = self.layers.get(block_name, {}), self.biases.get(block_name, {})
            for found, what in ((parts, "weight"), (biases, "bias")):
                if set(found) != {"gate", "up", "down"}:
                    raise CheckpointMismatch(f"{block_name}: the file lacks its experts' "
                                             f"{', '.join(sorted({'gate', 'up', 'down'} - set(found)))} {what} tensor(s)")
            for part, layers in parts.items():
                for e, layer in enumerate(layers):
                    layer.bias = nn.Parameter(biases[part][e], requires_grad=False)
            experts = block.experts
            block.experts = self.experts(block_name, parts, None, HalvesClampedSwiGLU(experts.alpha, experts.limit))
            router = block.router
            block.router = KernelRouter(self.router_layer(router.weight.detach(), router.bias.detach()),
                                        router.top_k, False, Routing(router.top_k, softmax_first=False))
            made += 3 * len(parts["down"])
            del self.layers[block_name]
        return made


def expert_tensors(model: nn.Module, device: torch.device | None = None) -> ExpertTensors:
    """What takes the model's stacked expert tensors from its file (`device`: a GPU's, the blocks kept there)."""
    kind = GptOssExpertTensors if model.config.model_type == gguf_gpt_oss.MODEL_TYPE else ExpertTensors
    return kind(model, device)
