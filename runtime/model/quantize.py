"""Quantized linear layers for the generator on a CPU (`[model] quantize`).

`int8` and `int4` replace every `nn.Linear` (the output head too: a head tied to the input embedding
gets a quantized copy, and the embedding, a row lookup, keeps its weights) by a module that keeps the
quantized weight and calls one kernel. `auto` (the default), on a CPU that can run ponder's int kernel
(x86-64 with AVX2), keeps a GGUF's linear layers stored in any block type the kernel runs
(runtime.model.gguf_blocks.SUPPORTED) as those very blocks rather than quantizing the dequantized
floats again (runtime.model.gguf_load does so while loading; `apply_quantize` on a loaded float model);
a layer of another type keeps float weights. A float model's float32 and bfloat16 layers then run in
ponder's float kernel (runtime.model.float_layers); `none` keeps torch's nn.Linear. `apply_quantize` says what a setting became (`Quantized`).

- int8: int8 weights with a scale per output channel, `aten._weight_int8pack_mm`, weight-only: the
  activations enter the kernel rounded to bfloat16 (vectorized on a CPU with AVX512-BF16).
- int4: 4-bit weights in groups of `INT4_GROUP_SIZE` input features, w = d * q + m with a float16 d
  and m per group, run by ponder's own kernel (runtime.kernels.cpu_kernels): the activations are quantized
  per group of 32 to int8 on the way in, as llama.cpp does for the same blocks, and the products
  are summed exactly in integers.

The int and float kernels compute each output row from its own input row only (tested), so batching
never changes a row's bits. A model whose layers a mode cannot take, or an `int4` setting on a machine
where the kernel cannot run, stops start-up with a `QuantizeError` naming the setting; nothing falls
back to float weights silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime.kernels.cpu_kernels import KernelUnavailable, q4_kernel, q4_unavailable
from runtime.model.block_pack import (pack_codes, pack_compact, pack_nibbles, pack_scales, unpack_codes,
                                      unpack_scales)
from runtime.model.quantize_setting import QuantizeError, check_device, check_mode

INT4_GROUP_SIZE = 32  # the kernel's group, a GGUF block
INT4_BLOCK_COLUMNS = 8  # output columns the kernel computes side by side
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TINY = torch.finfo(torch.float32).tiny
_TINY_HALF = torch.finfo(torch.float16).tiny
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default


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
        fused.bias = cat_bias(layers)
        share_rows(layers, fused, ("weight", "scales"))
        return fused


class Int4Linear(QuantizedLinear):
    """4-bit codes in groups of `INT4_GROUP_SIZE` input features, a code q standing for d * q + m with
    its group's float16 d and m (a GGUF Q4_1 block; Q4_0's d * (q - 8) has m = -8d), run by ponder's
    CPU kernel (runtime.kernels.cpu_kernels), which quantizes the activations per group to int8 on the way in.

    The buffers are in the kernel's layout (`pack_int4`): output columns in blocks of
    `INT4_BLOCK_COLUMNS` (the last one padded with zero columns), `weight` [blocks, 4 * in] bytes of
    codes, `d` and `m` [blocks, in / 32, 8] float16; `codes()` and `group_scales()` read them back.
    `from_blocks` makes the same layer from any GGUF block type the kernel runs (runtime.model.block_pack:
    5- or 8-bit codes, float32 scales for K-quants)."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                 bias: torch.Tensor | None = None) -> None:
        """`codes` [out, in] in 0..15; `d`, `m` [out, in / 32], exact in float16."""
        super().__init__()
        self.kernel = q4_kernel()
        self.out_features, self.in_features = codes.shape
        self.group_size = INT4_GROUP_SIZE
        weight, d, m = pack_int4(codes, d, m)
        self.register_buffer("weight", weight)
        self.register_buffer("d", d)
        self.register_buffer("m", m)
        self.bias = bias

    @classmethod
    def from_packed(cls, in_features: int, out_features: int, weight: torch.Tensor, d: torch.Tensor,
                    m: torch.Tensor | None, bias: torch.Tensor | None = None) -> "Int4Linear":
        """A layer from buffers already in the kernel's layout (`pack_int4`'s outputs, e.g. a start-up
        cache's), taken as they are."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.kernel, layer.group_size = q4_kernel(), INT4_GROUP_SIZE
        layer.in_features, layer.out_features = in_features, out_features
        layer.register_buffer("weight", weight)
        layer.register_buffer("d", d)
        layer.register_buffer("m", m)
        layer.bias = bias
        return layer

    @classmethod
    def from_blocks(cls, blocks, bias: torch.Tensor | None = None) -> "Int4Linear":
        """A layer computing with a GGUF tensor's very blocks (runtime.model.gguf_blocks.Blocks): its
        codes at their width (4, 5 or 8 bits), its scales in float16 where they are the file's own and
        float32 where they are products (K-quants)."""
        out_features, in_features = blocks.codes.shape
        codes = pack_codes(blocks.codes, blocks.bits)
        if blocks.compact is not None:  # a K-quant's scales as the file holds them
            super_d, sub_d, super_m, sub_m = blocks.compact
            m = None if super_m is None else pack_compact(super_m, sub_m)
            return cls.from_packed(in_features, out_features, codes, pack_compact(super_d, sub_d), m, bias)
        dtype = torch.float32 if blocks.float_scales else torch.float16
        m = None if blocks.m is None else pack_scales(blocks.m, dtype)
        return cls.from_packed(in_features, out_features, codes, pack_scales(blocks.d, dtype), m, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int4Linear":
        """`from_weight` of the layer's weight and bias."""
        return cls.from_weight(linear.weight, linear.bias)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int4Linear":
        """`weight` [out, in] in int4: each group's 16 codes spread evenly from its least to its largest
        weight (d and m rounded to float16 first, and the codes taken against the rounded values)."""
        weight = weight.detach().float()
        groups = weight.reshape(weight.shape[0], -1, INT4_GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        d = ((high - low) / 15).clamp(min=_TINY_HALF).half().float()
        m = low.half().float()
        codes = torch.round((groups - m[..., None]) / d[..., None]).clamp(0, 15)
        return cls(codes.reshape(weight.shape), d, m, bias)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x.float(), self.weight, self.d, self.m, self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def fused_rows(self, x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
        """`residual + rms_norm(x) @ W.T` for float32 rows in one kernel call (no bias)."""
        return self.kernel(x, self.weight, self.d, self.m, self.out_features, norm_weight, eps, residual)

    @classmethod
    def concatenated(cls, layers: list["Int4Linear"]) -> "Int4Linear | None":
        """As `Int8Linear.concatenated`; None when a layer other than the last does not fill its last block
        of columns, or when some layers have a scale per 16 inputs and some per 32. Layers of different
        formats (a mixed file's Q5_0 q and k beside a Q8_0 v) are first widened to one that holds each
        exactly (`widen`), which leaves every output's bits as they were."""
        if any(l.out_features % INT4_BLOCK_COLUMNS for l in layers[:-1]) or len({l.scale_groups for l in layers}) > 1:
            return None
        if len({(l.m is None, l.bits, l.d.dtype, l.d.shape[1:]) for l in layers}) > 1:
            dtype = torch.float16 if all(l.d.dtype == torch.float16 for l in layers) else torch.float32
            zero_points = any(l.m is not None for l in layers)
            for layer in layers:
                layer.widen(dtype, zero_points)
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.kernel, fused.group_size = layers[0].kernel, INT4_GROUP_SIZE
        fused.in_features, fused.out_features = layers[0].in_features, sum(l.out_features for l in layers)
        fused.register_buffer("weight", torch.cat([l.weight for l in layers]))
        fused.register_buffer("d", torch.cat([l.d for l in layers]))
        fused.register_buffer("m", None if layers[0].m is None else torch.cat([l.m for l in layers]))
        fused.bias = cat_bias(layers)
        share_rows(layers, fused, ("weight", "d", "m"))
        return fused

    @torch.no_grad()
    def widen(self, dtype: torch.dtype, zero_points: bool) -> None:
        """Hold the same weights as signed 8-bit codes with `dtype` scales (and zero points, 0 where the
        layer had none): every integer sum the kernel forms and every float operation after it stay
        the same, so the outputs keep their bits (tested)."""
        d, m = self.group_scales()
        if zero_points and m is None:
            m = torch.zeros_like(d)
        self.weight = pack_codes(self.codes().to(torch.int8), 8)
        self.d = pack_scales(d, dtype)
        self.m = None if m is None else pack_scales(m, dtype)

    @property
    def scale_groups(self) -> int:
        """Scales a row: in / 32, or in / 16 (Q2_K, Q3_K, Q6_K)."""
        return self.d.shape[1] * ((self.d.shape[2] - 16) // 8 if self.d.dtype == torch.uint8 else 1)

    @property
    def bits(self) -> int:
        """The codes' width: 4, 5 or 8 (runtime.model.block_pack)."""
        return self.weight.shape[1] // self.in_features

    def codes(self) -> torch.Tensor:
        """The codes `[out, in]` (0..15 or 0..31 uint8, int8 for 8 bits)."""
        return unpack_codes(self.weight, self.bits, self.out_features, self.in_features)

    def group_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(d, m) `[out, groups]` in float32 (m None for a layer without zero points)."""
        return unpack_scales(self.d, self.out_features), None if self.m is None else unpack_scales(self.m, self.out_features)

    def dequantized(self) -> torch.Tensor:
        d, m = self.group_scales()
        codes = self.codes().reshape(self.out_features, d.shape[1], -1).float()
        w = codes * d[..., None] + (0 if m is None else m[..., None])
        return w.reshape(self.out_features, self.in_features)


def pack_int4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The int4 kernel's layout (runtime.model.block_pack) of `codes` [out, in] in 0..15 and `d`, `m`
    [out, in / 32] exact in float16."""
    return pack_nibbles(codes), pack_scales(d, torch.float16), None if m is None else pack_scales(m, torch.float16)


def cat_bias(layers: list[nn.Module]) -> torch.Tensor | None:
    return None if layers[0].bias is None else torch.cat([l.bias.detach() for l in layers])


def share_rows(layers: list[nn.Module], fused: nn.Module, names: tuple[str, ...] = ("weight",)) -> None:
    """Make each layer's buffers `names` views of its rows of `fused`'s, so fusing costs no memory."""
    for name in names:
        whole, start = getattr(fused, name), 0
        if whole is None:
            continue
        for layer in layers:
            rows = getattr(layer, name).shape[0]
            setattr(layer, name, whole[start:start + rows])
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
        if mode == "int4" and q4_unavailable() is not None:
            raise QuantizeError(f"model.quantize = 'int4' needs ponder's int4 CPU kernel, which cannot run here: "
                                f"{q4_unavailable()}; set model.quantize = \"none\"")
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
    """What a `quantize` setting became: `mode` is none, int8, int4, float (ponder's float kernel
    runs the float layers) or gpu_blocks (a GGUF's blocks on a GPU, runtime.model.gpu_blocks); `detail`
    says where from."""

    setting: str
    mode: str
    layers: int
    detail: str
    block_types: tuple[str, ...] = ()  # the GGUF block types kept (`auto`), e.g. ("Q4_K", "Q6_K")

    def describe(self) -> str:
        return f"model.quantize = {self.setting}: {self.mode} ({self.detail})"


@torch.no_grad()
def apply_quantize(model: nn.Module, setting: str, gguf_path: str | None = None) -> Quantized:
    """Apply the `quantize` setting to a loaded model. `auto`: on a CPU that runs the int kernel, a model
    loaded from a GGUF keeps every linear layer stored in a supported block type as those very blocks
    (a head tied to the embedding keeps the embedding's); any other layer or model keeps float weights,
    which the caller hands to runtime.model.float_layers for a float model on a CPU."""
    check_mode(setting)
    if setting != "auto":
        layers = quantize_model(model, setting)
        return Quantized(setting, setting, layers, "as set" if layers else "float weights")
    device = next(model.parameters()).device
    if device.type != "cpu":
        return Quantized(setting, "none", 0, f"the quantized kernels are the CPU's, and the model is on {device.type}")
    if gguf_path is None:
        return Quantized(setting, "none", 0, "not a GGUF model")
    try:
        q4_kernel()
    except KernelUnavailable as exc:
        return Quantized(setting, "none", 0, str(exc))
    from runtime.model.gguf_blocks import linear_blocks

    try:
        blocks, found = linear_blocks(model, gguf_path)
    except ValueError as exc:
        raise QuantizeError(f"model.quantize = 'auto' cannot keep the GGUF's blocks: {exc}; "
                            "set model.quantize = \"none\"") from None
    if not blocks:
        return Quantized(setting, "none", 0, f"no linear layers of a type the int kernel runs in the GGUF; {found}")
    layers = linear_layers(model)
    kept: dict[str, int] = {}
    for name, parent, attribute, layer in layers:
        b = blocks.get(name)
        if b is not None:
            setattr(parent, attribute, Int4Linear.from_blocks(b, layer.bias))
            kept[b.kind] = kept.get(b.kind, 0) + 1
    _untie(model)
    return Quantized(setting, "int4", len(blocks), blocks_detail(kept, len(layers) - len(blocks), found), tuple(sorted(kept)))


def blocks_detail(kept: dict[str, int], floats: int, found: str, in_float_kernel: dict[str, int] | None = None) -> str:
    """What `auto` did with a GGUF's linear layers, for the start-up line: the block types kept, the
    float tensors (F32, F16, BF16) ponder's float kernel runs in their own type, how many layers keep
    float weights in torch's matmul (a type no kernel of ponder's runs, named in `found`), and the
    file's linear tensor types."""
    from runtime.model.gguf_blocks import SUPPORTED

    def counts(by_kind: dict[str, int]) -> str:
        return ", ".join(f"{count} {kind}" for kind, count in sorted(by_kind.items()))

    parts = [f"{sum(kept.values())} layers keep the GGUF's blocks ({counts(kept)})"] if kept else []
    if in_float_kernel:
        parts.append(f"{sum(in_float_kernel.values())} {'run' if kept else 'layers run'} in ponder's float kernel in the "
                     f"file's own type ({counts(in_float_kernel)})")
    if floats:
        others = sorted({part.split()[-1] for part in found.split(": ", 1)[-1].split(", ")}
                        - set(SUPPORTED) - set(in_float_kernel or ()))
        parts.append(f"{floats} keep float weights (no kernel of ponder's for {', '.join(others) or 'their type'})")
    return f"{', '.join(parts)}; {found}"


def _untie(model: nn.Module) -> None:
    # A head tied to the input embedding is now a quantized copy; the embedding keeps its weights.
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False
