"""A linear layer over a GGUF's own blocks (codes, d, m as runtime.model.gguf_blocks keeps them) computed on
a GPU by ponder's Triton block GEMM (runtime/kernels/gpu/linear.py): the file's weights, dequantized in
registers, each row's outputs its own bits whatever the batch.

The loader makes these layers on a GPU with `quantize = "auto"` (runtime.model.gguf_load with a device,
`gpu_block_layer`): every linear tensor of a type the blocks cover (gguf_blocks.SUPPORTED) keeps the
file's codes and scales, nothing quantized again. Codes that fit in 4 bits (Q4_0, Q4_1, Q4_K, Q2_K) are
held two a byte (`packed`), the others (5-bit, the signed 6- and 8-bit codes, IQ4's values) one a byte;
d and m are float32 per group of 32 inputs (16 for Q2_K, Q3_K, Q6_K). A Q4_K layer so holds 4 bits a
weight plus 2 of scales, against the file's 4.5."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from runtime.model.gguf_blocks import Blocks, decode
from runtime.model.quantize import QuantizedLinear, cat_bias, share_rows

_SLAB_WEIGHTS = 1 << 20  # weights decoded at a time: the host holds one slab's codes, not a whole tensor's


def is_packed(blocks: Blocks) -> bool:
    """Whether the codes fit in 4 bits (unsigned, 0..15): held two a byte."""
    return blocks.codes.dtype == torch.uint8 and blocks.bits == 4


class GpuBlockLinear(QuantizedLinear):
    """w = d * codes + m per group of `in_features / groups` inputs; `forward(x)` is x @ w.T (+ bias)."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, packed: bool = False,
                 bias: torch.Tensor | None = None) -> None:
        """`packed`: `codes` holds two 4-bit codes a byte (runtime.kernels.gpu.linear.pack_nibbles)."""
        super().__init__()
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * (2 if packed else 1)
        self.packed = packed
        self.register_buffer("weight", codes)
        self.register_buffer("d", d.float())
        self.register_buffer("m", None if m is None else m.float())
        self.bias = bias

    @classmethod
    def from_blocks(cls, blocks: Blocks, device: torch.device | str = "cpu") -> "GpuBlockLinear":
        """A layer of one tensor's blocks on `device`, the codes packed where they fit in 4 bits."""
        from runtime.kernels.gpu.linear import pack_nibbles

        packed = is_packed(blocks)
        codes = pack_nibbles(blocks.codes) if packed else blocks.codes
        return cls(codes.to(device), blocks.d.to(device), None if blocks.m is None else blocks.m.to(device), packed)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        from runtime.kernels.gpu.linear import block_linear

        y = block_linear(x, self.weight, self.d, self.m, self.packed)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        codes = self.weight
        if self.packed:
            codes = torch.stack((codes & 15, codes >> 4), dim=-1).reshape(self.out_features, self.in_features)
        groups = codes.reshape(*self.d.shape, -1).float() * self.d[..., None]
        if self.m is not None:
            groups = groups + self.m[..., None]
        return groups.reshape(self.out_features, self.in_features)

    @property
    def form(self) -> tuple:
        """What one kernel call needs alike in every layer it computes."""
        return self.packed, self.weight.dtype, self.d.shape[1], self.m is None

    @classmethod
    def concatenated(cls, layers: list["GpuBlockLinear"]) -> "QuantizedLinear":
        """One layer computing `layers`' outputs side by side (each output from its own row's codes and
        scales only, so the same bits); the layers' buffers become views of its own. Layers of different
        forms (a Q4_K_M file's Q4_K q and k beside a Q6_K v) stay as they are, one call each
        (`SideBySide`), rather than widened to a form that holds them all at more bytes."""
        if len({layer.form for layer in layers}) > 1:
            return SideBySide(layers)
        m = None if layers[0].m is None else torch.cat([layer.m for layer in layers])
        fused = cls(torch.cat([layer.weight for layer in layers]), torch.cat([layer.d for layer in layers]), m,
                    layers[0].packed, cat_bias(layers))
        share_rows(layers, fused, ("weight", "d", "m"))
        return fused

    @property
    def nbytes(self) -> int:
        """Bytes one call reads of the layer: codes and scales."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.d, self.m) if t is not None)


class SideBySide(QuantizedLinear):
    """`layers`' outputs side by side, each computed by its own layer: what `concatenated` fuses where the
    layers' forms differ. Holds nothing of its own (the layers are their buffers' one owner)."""

    def __init__(self, layers: list[QuantizedLinear]) -> None:
        super().__init__()
        self.__dict__["parts"] = list(layers)  # not submodules: the model holds them already
        self.in_features, self.out_features = layers[0].in_features, sum(layer.out_features for layer in layers)
        self.bias = None  # (each part adds its own)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer.rows(x) for layer in self.parts], dim=-1)

    def dequantized(self) -> torch.Tensor:
        return torch.cat([layer.dequantized() for layer in self.parts])


def gpu_block_layer(kind: str, rows: Callable[[int, int], np.ndarray], shape: tuple[int, int],
                    device: torch.device | str, slab_rows: int | None = None) -> GpuBlockLinear:
    """A layer on `device` of the `[out, bytes]` blocks of `kind` that `rows(start, stop)` gives, decoded a
    slab of rows at a time into the device's buffers (`slab_rows`: a million weights' by default)."""
    out_features, in_features = shape
    slab_rows = slab_rows or max(1, _SLAB_WEIGHTS // in_features)
    layer = None
    for start in range(0, out_features, slab_rows):
        stop = min(start + slab_rows, out_features)
        slab = GpuBlockLinear.from_blocks(decode(kind, rows(start, stop)))
        if layer is None:
            def room(t):
                return None if t is None else torch.empty((out_features, *t.shape[1:]), dtype=t.dtype, device=device)
            layer = GpuBlockLinear(room(slab.weight), room(slab.d), room(slab.m), slab.packed)
        for name in ("weight", "d", "m"):
            if getattr(slab, name) is not None:
                getattr(layer, name)[start:stop] = getattr(slab, name)
    return layer
