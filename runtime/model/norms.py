"""The RMS norms of the lean decoder (runtime.model.decoder), each transformers' arithmetic operator for
operator (conversions that change nothing skipped), read once from the model's norm modules.

- `RMSNorm`: LlamaRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm (SmolLM3's too): normalised in float32, rounded
  to the activations' dtype, then times the weight (in the weight's dtype);
- `OffsetRMSNorm`: Gemma3RMSNorm and Qwen3.5's Qwen3_5RMSNorm (its MoE's too): normalised in float32,
  times (1 + weight) in float32, then rounded (they multiply before rounding, llama after; their weights
  are offsets from one);
- `WeightFirstRMSNorm`: GptOssRMSNorm: normalised in float32, times the weight (float32 products where
  the weight is narrower), then rounded (llama's bits wherever the activations are float32).

ponder's int4 and float kernels, which fuse a norm into the projection after it, compute `RMSNorm`
only: a model with another norm runs the lean decoder's Python loop (`is_kernel_form`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm


@dataclass
class RMSNorm:
    weight: torch.Tensor
    eps: float

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        wide = hidden.dtype == torch.float32
        x = hidden if wide else hidden.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * (x if wide else x.to(hidden.dtype))


@dataclass
class OffsetRMSNorm:
    weight: torch.Tensor
    eps: float
    # 1 + weight in float32, as transformers computes it each call (the same bits once)
    scale: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.scale = 1.0 + self.weight.detach().float()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = x * self.scale
        return x if x.dtype == hidden.dtype else x.to(hidden.dtype)


@dataclass
class WeightFirstRMSNorm:
    weight: torch.Tensor
    eps: float

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.weight * x
        return x if x.dtype == hidden.dtype else x.to(hidden.dtype)


Norm = RMSNorm | OffsetRMSNorm | WeightFirstRMSNorm
# transformers' other (1 + weight) norms of Gemma3RMSNorm's arithmetic, by class name (their weight and `eps`)
OFFSET_NORMS = ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm")


def norm_of(module: nn.Module | None) -> Norm | None:
    """The norm `module` computes, None where it is of no form known here."""
    if isinstance(module, Gemma3RMSNorm) or type(module).__name__ in OFFSET_NORMS:
        return OffsetRMSNorm(module.weight, module.eps)
    if isinstance(module, GptOssRMSNorm):
        return WeightFirstRMSNorm(module.weight, module.variance_epsilon)
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    return None if weight is None or eps is None else RMSNorm(weight, eps)


def is_kernel_form(*norms: Norm | None) -> bool:
    """Whether each norm (None: none) is the one ponder's kernels fuse into a projection (`RMSNorm`)."""
    return all(norm is None or isinstance(norm, RMSNorm) for norm in norms)
