"""Quantized linear layers for the generator on a CPU (`[model] quantize`).

`int8` and `int4` replace every `nn.Linear` (the output head too: a head tied to the input embedding
gets a quantized copy, and the embedding, a row lookup, keeps its weights) by a module that keeps the
quantized weight and calls one torch kernel. `auto` (the default) does the same with int4 on a CPU
with native bfloat16 for a GGUF whose linear layers are stored as 4-bit blocks, taking those very
blocks (runtime.gguf_blocks) rather than quantizing the dequantized floats again; otherwise it keeps
float weights. `apply_quantize` says what a setting became (`Quantized`).

- int8: int8 weights with a scale per output channel, `aten._weight_int8pack_mm`.
- int4: 4-bit weights in groups of `INT4_GROUP_SIZE` input features, each group with a scale and a
  zero point, `aten._weight_int4pack_mm_for_cpu`.

Both are weight-only: the activations enter the kernel rounded to bfloat16, whose kernels are the
vectorized ones on a CPU with AVX512-BF16 (with float32 input they ran up to 40x slower there).
Both kernels compute each output row from its own input row only (tested), so batching never
changes a row's bits, and the engine's greedy tokens equal transformers' `generate` on the same
quantized model. A model whose layers a mode cannot take stops
start-up with a `QuantizeError` naming the setting; nothing falls back to float weights silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.loader import SettingError, runs_natively

QUANTIZE_MODES = ("auto", "none", "int8", "int4")
INT4_GROUP_SIZE = 32
INT4_PACK_ROWS = 64  # _convert_weight_to_int4pack_for_cpu lays rows out in blocks of 64
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TINY = torch.finfo(torch.float32).tiny
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default


class QuantizeError(SettingError):
    """A `quantize` setting the model's layers cannot take; the message is one line naming it."""


class QuantizedLinear(nn.Module):
    """A linear layer with quantized weights: `forward(x)` equals `x @ dequantized().T + bias`.
    `weight` holds the codes (packed for int4); `in_features` and `out_features` are nn.Linear's."""

    in_features: int
    out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` for `x` `[rows, in_features]`, without the reshapes."""
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(QuantizedLinear):
    """int8 weights with one scale per output channel (weight-only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=_TINY) / 127
        self.register_buffer("weight", torch.round(weight / scales[:, None]).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))  # the kernel's scales match its input
        self.bias = linear.bias

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        y = _INT8_MM(x.to(torch.bfloat16), self.weight, self.scales).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        return self.weight.float() * self.scales.float()[:, None]

    @classmethod
    def concatenated(cls, layers: list["Int8Linear"]) -> "Int8Linear":
        """One layer whose outputs are `layers`' outputs side by side, each column's bits unchanged
        (the kernel computes a column from its own weights only); the layers' weights become views of it."""
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.in_features, fused.out_features = layers[0].in_features, sum(l.out_features for l in layers)
        fused.register_buffer("weight", torch.cat([l.weight for l in layers]))
        fused.register_buffer("scales", torch.cat([l.scales for l in layers]))
        fused.bias = _cat_bias(layers)
        _share_rows(layers, fused.weight)
        return fused


class Int4Linear(QuantizedLinear):
    """4-bit codes in groups of `INT4_GROUP_SIZE` input features; the kernel computes a code q as
    (q - 8) * scale + zero with its group's scale and zero point (weight-only)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None, group_size: int = INT4_GROUP_SIZE) -> None:
        """`codes` [out, in] in 0..15; `scales`, `zeros` [out, in / group_size]."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group_size = group_size
        # The packing takes rows in multiples of 16: padding rows are zero and cut off the output.
        self.padded_out_features = -(-self.out_features // 16) * 16
        pad = (0, 0, 0, self.padded_out_features - self.out_features)
        codes, scales, zeros = (F.pad(t, pad) for t in (codes.to(torch.int32), scales.float(), zeros.float()))
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1)  # [groups, out, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16).contiguous())
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = INT4_GROUP_SIZE) -> "Int4Linear":
        """Each group's 16 codes spread evenly from its least to its largest weight."""
        weight = linear.weight.detach().float()
        groups = weight.reshape(linear.out_features, linear.in_features // group_size, group_size)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = (high - low).clamp(min=_TINY) / 15
        codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
        # The kernel dequantizes a code q as (q - 8) * scale + zero: zero is the group's value at code 8.
        return cls(codes.reshape(weight.shape), scales, low + 8 * scales, linear.bias, group_size)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        y = _INT4_MM(x.to(torch.bfloat16), self.weight, self.group_size, self.scales_and_zeros)
        if self.padded_out_features != self.out_features:
            y = y[:, :self.out_features]
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    @classmethod
    def concatenated(cls, layers: list["Int4Linear"]) -> "Int4Linear | None":
        """As `Int8Linear.concatenated`; None unless every layer has a multiple of `INT4_PACK_ROWS` rows
        (the packed weight interleaves rows in blocks of that many, so only whole blocks line up)."""
        if any(l.out_features % INT4_PACK_ROWS or l.group_size != layers[0].group_size for l in layers):
            return None
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.in_features, fused.out_features = layers[0].in_features, sum(l.out_features for l in layers)
        fused.padded_out_features, fused.group_size = fused.out_features, layers[0].group_size
        fused.register_buffer("weight", torch.cat([l.weight for l in layers]))
        fused.register_buffer("scales_and_zeros", torch.cat([l.scales_and_zeros for l in layers], dim=1).contiguous())
        fused.bias = _cat_bias(layers)
        _share_rows(layers, fused.weight)
        return fused

    def dequantized(self) -> torch.Tensor:
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.weight, self.group_size,
                                                           self.scales_and_zeros)[:, :self.out_features].T.float()


def _cat_bias(layers: list[nn.Module]) -> torch.Tensor | None:
    return None if layers[0].bias is None else torch.cat([l.bias.detach() for l in layers])


def _share_rows(layers: list[nn.Module], weight: torch.Tensor) -> None:
    """Make each layer's `weight` buffer a view of its rows of `weight`, so fusing costs no memory."""
    start = 0
    for layer in layers:
        rows = layer.weight.shape[0]
        layer.weight = weight[start:start + rows]
        start += rows


_MODULES = {"int8": Int8Linear, "int4": Int4Linear.from_linear}


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(qualified name, parent, attribute, layer) for every `nn.Linear` in the model."""
    found = []
    for parent_name, parent in model.named_modules():
        for attribute, child in parent.named_children():
            if isinstance(child, nn.Linear):
                found.append((f"{parent_name}.{attribute}" if parent_name else attribute, parent, attribute, child))
    return found


def check_mode(mode: str) -> None:
    if mode not in QUANTIZE_MODES:
        raise QuantizeError(f"model.quantize = {mode!r} is not one of {', '.join(QUANTIZE_MODES)}")


def check_device(mode: str, device: torch.device, where: str = "model.device is") -> None:
    """Raise `QuantizeError` unless `mode` can run on `device` (the quantized kernels are the CPU's)."""
    if mode not in ("none", "auto") and device.type != "cpu":
        raise QuantizeError(f"model.quantize = {mode!r} runs on the CPU only, and {where} {device.type}; "
                            "set model.quantize = \"none\" or model.device = \"cpu\"")


def check_quantizable(model: nn.Module, mode: str) -> None:
    """Raise `QuantizeError` (one line, naming the setting) unless every linear layer can take `mode`."""
    check_mode(mode)
    if mode in ("none", "auto"):
        return
    for name, _, _, layer in linear_layers(model):
        check_device(mode, layer.weight.device, f"{name} is on")
        if layer.weight.dtype not in _SUPPORTED_DTYPES:
            raise QuantizeError(f"model.quantize = {mode!r} cannot take {name}: its weights are "
                                f"{str(layer.weight.dtype).removeprefix('torch.')}")
        if mode == "int4" and layer.in_features % INT4_GROUP_SIZE:
            raise QuantizeError(f"model.quantize = 'int4' needs in_features divisible by the group size "
                                f"{INT4_GROUP_SIZE}, and {name} has {layer.in_features}")


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str) -> int:
    """Replace every linear layer of `model` by its `mode` form; returns how many were replaced.
    Checks every layer before changing any, so a failure leaves the model as it was."""
    check_quantizable(model, mode)
    if mode == "auto":
        raise ValueError("quantize_model takes none, int8 or int4; apply_quantize resolves auto")
    if mode == "none":
        return 0
    layers = linear_layers(model)
    for _, parent, attribute, layer in layers:
        setattr(parent, attribute, _MODULES[mode](layer))
    _untie(model)
    return len(layers)


@dataclass(frozen=True)
class Quantized:
    """What a `quantize` setting became: `mode` is none, int8 or int4; `detail` says where from."""

    setting: str
    mode: str
    layers: int
    detail: str

    def describe(self) -> str:
        return f"model.quantize = {self.setting}: {self.mode} ({self.detail})"


@torch.no_grad()
def apply_quantize(model: nn.Module, setting: str, gguf_path: str | None = None) -> Quantized:
    """Apply the `quantize` setting to a loaded model. `auto`: on a CPU with native bfloat16, a model
    loaded from a GGUF whose linear layers are stored as 4-bit blocks keeps those very blocks as int4
    layers (any other linear layer, e.g. a head tied to a Q8_0 embedding, is quantized to int4 from
    its loaded weights); anything else keeps its float weights."""
    check_mode(setting)
    if setting != "auto":
        layers = quantize_model(model, setting)
        return Quantized(setting, setting, layers, "as set" if layers else "float weights")
    device = next(model.parameters()).device
    if device.type != "cpu":
        return Quantized(setting, "none", 0, f"the quantized kernels are the CPU's, and the model is on {device.type}")
    if gguf_path is None:
        return Quantized(setting, "none", 0, "not a GGUF model")
    if not runs_natively(torch.bfloat16, device):
        return Quantized(setting, "none", 0, "this CPU has no native bfloat16 arithmetic (AVX512-BF16 or AMX), "
                                             "without which the int4 kernel is slower than float32")
    from runtime.gguf_blocks import linear_blocks

    try:
        blocks, found = linear_blocks(model, gguf_path)
    except ValueError as exc:
        raise QuantizeError(f"model.quantize = 'auto' cannot keep the GGUF's blocks: {exc}; "
                            "set model.quantize = \"none\"") from None
    if not blocks:
        return Quantized(setting, "none", 0, f"no 4-bit linear layers in the GGUF; {found}")
    layers = linear_layers(model)
    rest_float = 0
    for name, parent, attribute, layer in layers:
        b = blocks.get(name)
        if b is None and layer.in_features % INT4_GROUP_SIZE == 0 and layer.weight.dtype in _SUPPORTED_DTYPES:
            setattr(parent, attribute, Int4Linear.from_linear(layer))
        elif b is None:
            rest_float += 1
        else:
            setattr(parent, attribute, Int4Linear(b.codes, *b.scales_and_zeros(), layer.bias))
    _untie(model)
    rest = len(layers) - len(blocks) - rest_float
    detail = f"{len(blocks)} layers keep the GGUF's 4-bit blocks" + \
        (f", {rest} quantized from their weights" if rest else "") + \
        (f", {rest_float} keep float weights" if rest_float else "") + f"; {found}"
    return Quantized(setting, "int4", len(layers) - rest_float, detail)


def _untie(model: nn.Module) -> None:
    # A head tied to the input embedding is now a quantized copy; the embedding keeps its weights.
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False
