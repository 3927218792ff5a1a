"""A linear layer over a GGUF's own blocks (codes, d, m as runtime.model.gguf_blocks keeps them) computed on
a GPU by ponder's Triton block GEMM (runtime/kernels/gpu/linear.py): the file's weights, dequantized in
registers, each row's outputs its own bits whatever the batch.

The loader makes these layers on a GPU with `quantize = "auto"` (runtime.model.gguf_load with a device,
`gpu_block_layer`): every linear tensor of a type the blocks cover (gguf_blocks.SUPPORTED) keeps the
file's codes and scales, nothing quantized again. Codes that fit in 4 bits (Q4_0, Q4_1, Q4_K, Q2_K, and
Q3_K's -4..3 plus 4) are held two a byte (`packed`); 5- and 6-bit codes (Q5_0, Q5_1, Q5_K, and Q6_K's
-32..31 plus 32) as their low nibbles so and their two high bits four a byte (`high`), the `offset`
taken off in the kernel; the others (Q8_0, IQ4's values, MXFP4's) one a byte;
d and m are float32 per group of 32 inputs (16 for Q2_K, Q3_K, Q6_K), or for the K-quants and IQ4_XS
as the file holds them (`Blocks.compact`): an int8 sub-scale a group and a float32 super-block scale a
256 inputs, multiplied in the kernel to gguf's float32 product. A Q4_K layer so holds 4 bits a weight
plus 0.75 of scales (2 as float32 products), against the file's 4.5."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from runtime.model.gguf_blocks import Blocks, decode
from runtime.model.quantize import QuantizedLinear, cat_bias, share_rows

_SLAB_WEIGHTS = 1 << 20  # weights decoded at a time: the host holds one slab's codes, not a whole tensor's


# kinds whose codes are held as 6 bits (a low nibble two a byte, two high bits four a byte), stored unsigned:
# the code plus this offset
SIX_BITS = {"Q5_0": 0, "Q5_1": 0, "Q5_K": 0, "Q6_K": 32}
NIBBLE_OFFSETS = {"Q3_K": 4}  # signed codes that fit 4 bits once the offset is added (Q3_K's -4..3)


def code_form(blocks: Blocks) -> tuple[bool, bool, int]:
    """(packed: the codes' low nibbles two a byte; high: their two high bits four a byte too; the offset
    added to store them unsigned) for a tensor's blocks; (False, False, 0): a byte a code."""
    if blocks.codes.dtype == torch.uint8 and blocks.bits == 4:
        return True, False, 0
    if blocks.kind in NIBBLE_OFFSETS:
        return True, False, NIBBLE_OFFSETS[blocks.kind]
    if blocks.kind in SIX_BITS:
        return True, True, SIX_BITS[blocks.kind]
    return False, False, 0


SCALES = ("weight", "high", "d", "m", "d_super", "m_super")  # a layer's buffers


class GpuBlockLinear(QuantizedLinear):
    """w = d * codes + m per group of `in_features / groups` inputs; `forward(x)` is x @ w.T (+ bias)."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, packed: bool = False,
                 bias: torch.Tensor | None = None, d_super: torch.Tensor | None = None,
                 m_super: torch.Tensor | None = None, high: torch.Tensor | None = None, offset: int = 0) -> None:
        """`packed`: `codes` holds two 4-bit codes a byte (runtime.kernels.gpu.linear.pack_nibbles), or
        with `high` `[out, in / 4]` (`pack_pairs`) 6-bit codes' low nibbles, their two high bits there;
        the stored codes are the codes plus `offset`. `d_super` (and `m_super` with an `m`): float32
        super-block scales `[out, supers]`, `d` and `m` then int8 sub-scales that they multiply (a
        K-quant's `Blocks.compact`)."""
        super().__init__()
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * (2 if packed else 1)
        self.packed, self.offset = packed, offset
        compact = d_super is not None
        self.register_buffer("weight", codes)
        self.register_buffer("high", high)
        self.register_buffer("d", d if compact else d.float())
        self.register_buffer("m", None if m is None else m if compact else m.float())
        self.register_buffer("d_super", d_super)
        self.register_buffer("m_super", m_super)
        self.bias = bias

    @classmethod
    def from_blocks(cls, blocks: Blocks, device: torch.device | str = "cpu") -> "GpuBlockLinear":
        """A layer of one tensor's blocks on `device`, the codes in 4 or 6 bits where they fit (`code_form`),
        a K-quant's scales as the file holds them."""
        from runtime.kernels.gpu.linear import pack_nibbles, pack_pairs

        packed, six, offset = code_form(blocks)
        codes, high = blocks.codes, None
        if packed:
            stored = (codes.to(torch.int16) + offset).to(torch.uint8)
            codes, high = pack_nibbles(stored & 15), pack_pairs(stored >> 4) if six else None
        on = lambda t: None if t is None else t.to(device)  # noqa: E731
        if blocks.compact is not None:
            d_super, d, m_super, m = blocks.compact
            return cls(on(codes), on(d), on(m), packed, d_super=on(d_super), m_super=on(m_super), high=on(high),
                       offset=offset)
        return cls(on(codes), on(blocks.d), on(blocks.m), packed, high=on(high), offset=offset)

    def rows(self, x: torch.Tensor, act: int = 0) -> torch.Tensor:
        """`act` (1 SiLU, 2 GELU's tanh form): `x` is a fused gate/up output and the layer's inputs act(gate) * up
        (runtime.kernels.gpu.linear.block_linear: computed as the kernel loads them)."""
        from runtime.kernels.gpu.linear import block_linear

        supers = None if self.d_super is None else (self.d_super, self.m_super)
        y = block_linear(x, self.weight, self.d, self.m, self.packed, supers=supers, high=self.high, offset=self.offset,
                         act=act)
        return y if self.bias is None else y + self.bias

    def scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(d, m) as float32 `[out, groups]`: the super-block scales' products where the layer keeps them."""
        if self.d_super is None:
            return self.d, self.m
        per = self.d.shape[1] // self.d_super.shape[1]
        d = self.d_super.repeat_interleave(per, dim=1) * self.d.float()
        return d, None if self.m is None else self.m_super.repeat_interleave(per, dim=1) * self.m.float()

    def dequantized(self) -> torch.Tensor:
        codes = self.weight
        if self.packed:
            shape = (self.out_features, self.in_features)
            codes = torch.stack((codes & 15, codes >> 4), dim=-1).reshape(shape).to(torch.int16)
            if self.high is not None:
                top = torch.stack([(self.high >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1).reshape(shape)
                codes = codes | (top.to(torch.int16) << 4)
            codes = codes - self.offset
        d, m = self.scales()
        groups = codes.reshape(*d.shape, -1).float() * d[..., None]
        if m is not None:
            groups = groups + m[..., None]
        return groups.reshape(self.out_features, self.in_features)

    @property
    def form(self) -> tuple:
        """What one kernel call needs alike in every layer it computes."""
        supers = None if self.d_super is None else self.d_super.shape[1]
        return self.packed, self.weight.dtype, self.d.shape[1], self.m is None, supers, self.high is None, self.offset

    @classmethod
    def concatenated(cls, layers: list["GpuBlockLinear"]) -> "QuantizedLinear":
        """One layer computing `layers`' outputs side by side (each output from its own row's codes and
        scales only, so the same bits); the layers' buffers become views of its own. Layers of different
        forms (a Q4_K_M file's Q4_K q and k beside a Q6_K v) stay as they are, one call each
        (`SideBySide`), rather than widened to a form that holds them all at more bytes."""
        if len({layer.form for layer in layers}) > 1:
            return SideBySide(layers)
        joined = {name: None if getattr(layers[0], name) is None else torch.cat([getattr(layer, name) for layer in layers])
                  for name in SCALES}
        fused = cls(joined["weight"], joined["d"], joined["m"], layers[0].packed, cat_bias(layers),
                    d_super=joined["d_super"], m_super=joined["m_super"], high=joined["high"], offset=layers[0].offset)
        share_rows(layers, fused, SCALES)
        return fused

    @property
    def nbytes(self) -> int:
        """Bytes one call reads of the layer: codes and scales."""
        return sum(t.numel() * t.element_size() for t in (getattr(self, name) for name in SCALES) if t is not None)


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
            layer = GpuBlockLinear(room(slab.weight), room(slab.d), room(slab.m), slab.packed,
                                   d_super=room(slab.d_super), m_super=room(slab.m_super), high=room(slab.high),
                                   offset=slab.offset)
        for name in SCALES:
            if getattr(slab, name) is not None:
                getattr(layer, name)[start:stop] = getattr(slab, name)
    return layer
