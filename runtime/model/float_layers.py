"""ponder's float kernel for a float model's linear layers on a CPU (`[model] quantize = "auto"`).

A float model (a safetensors checkpoint) on a CPU where ponder's kernels build runs every float32,
bfloat16 or float16 linear layer whose input width is a multiple of 16 in
`runtime/kernels/csrc/float_linear.cpp`, and so does a GGUF's F32, F16 or BF16 linear tensor
(runtime.model.gguf_load, the file's values in the file's type): each output summed in one fixed order, so a row's bits never
depend on the batch and batch invariance needs no padding (runtime.model.row_padding probes only
torch's layers). Reward models on a CPU run the same (runtime.verify.verifier_store).
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.kernels.cpu_kernels import KernelUnavailable, float_kernel
from runtime.model.quantize import Quantized, QuantizedLinear, cat_bias, linear_layers, share_rows


class FloatLinear(QuantizedLinear):
    """nn.Linear's own float32, bfloat16 or float16 weights run by ponder's CPU kernel, which computes
    every output in one fixed order whatever the batch, so no padding is needed for invariance. Its
    bits differ from torch's matmul in the last places; `quantize = "none"` keeps torch's.

    float32 weights that are all bfloat16 values (a bfloat16 checkpoint computed in float32, the CPU's
    default dtype), or else all float16 values, are kept in that type: the kernel widens them back
    exactly, so the outputs are the same bits, read in half the bytes. Other weights are not copied (a
    head tied to the embedding stays tied)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", narrowest(linear.weight.detach()))
        self.bias = linear.bias
        self.kernel = float_kernel()

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "FloatLinear":
        """A layer of `weight` [out, in] as it is (float32, bfloat16 or float16: a GGUF tensor's own
        values, not widened)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features = weight.shape
        layer.register_buffer("weight", weight)
        layer.bias = bias
        layer.kernel = float_kernel()
        return layer

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        y = self.kernel(x.float(), self.weight, bias)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        return self.weight.float()

    @classmethod
    def concatenated(cls, layers: list["FloatLinear"]) -> "FloatLinear":
        """As `Int8Linear.concatenated` (the kernel computes a column from its own weights only)."""
        fused = cls.from_weight(torch.cat([l.weight for l in layers]), cat_bias(layers))
        share_rows(layers, fused)
        return fused

    @staticmethod
    def takes(layer: nn.Linear) -> bool:
        return takes_weight(layer.weight)


def takes_weight(weight: torch.Tensor) -> bool:
    """Whether ponder's float kernel computes with `weight` [out, in]."""
    return weight.dtype in (torch.float32, torch.bfloat16, torch.float16) and weight.shape[-1] % 16 == 0


def narrowest(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in bfloat16, or else float16, where that holds each of its float32 values exactly."""
    if weight.dtype == torch.float32:
        for dtype in (torch.bfloat16, torch.float16):
            narrow = weight.to(dtype)
            if torch.equal(narrow.to(torch.float32), weight):
                return narrow
    return weight


def float_layers(model: nn.Module, setting: str = "auto") -> Quantized:
    """`quantize = "auto"` on a float model on a CPU (after `apply_quantize` found no GGUF): every linear
    layer whose weights ponder's float kernel takes runs there (`FloatLinear`); the others, and every
    layer where the kernel cannot run, keep torch's. `setting` is only what the result names."""
    try:
        float_kernel()
    except KernelUnavailable as exc:
        return Quantized(setting, "none", 0, f"not a GGUF model; torch's matmuls ({exc})")
    layers = linear_layers(model)
    taken = [(parent, attribute, layer) for _, parent, attribute, layer in layers if FloatLinear.takes(layer)]
    if not taken:
        return Quantized(setting, "none", 0, "not a GGUF model; no layer ponder's float kernel takes")
    kept: dict[str, int] = {}
    for parent, attribute, layer in taken:
        float_layer = FloatLinear(layer)
        setattr(parent, attribute, float_layer)
        name = str(float_layer.weight.dtype).removeprefix("torch.")
        if float_layer.weight.dtype != layer.weight.dtype:
            name += f" (float32 weights of {name} values, kept as {name})"
        kept[name] = kept.get(name, 0) + 1
    rest = len(layers) - len(taken)
    detail = f"{len(taken)} layers in ponder's float kernel ({', '.join(f'{n} {k}' for k, n in sorted(kept.items()))})" + (
        f", {rest} in torch's matmul (in_features not a multiple of 16)" if rest else "")
    return Quantized(setting, "float", len(taken), detail)
