"""A linear layer over a GGUF's own blocks (codes, d, m as runtime.model.gguf_blocks keeps them) computed on
a GPU by ponder's Triton block GEMM (runtime/kernels/gpu/linear.py): the file's weights, dequantized in
registers, each row's outputs its own bits whatever the batch.

Used by the device check's 4-bit figures (bench/gpu.py); the loader does not yet keep a GGUF's blocks on
a GPU (`quantize = "auto"` there still dequantizes to bf16). The codes are one byte each as the CPU
kernels' layout keeps them, or (`packed`) two 4-bit codes a byte: 4 bits a weight plus the float32
scales (2 bits a weight), against the file's 4.5."""

from __future__ import annotations

import torch

from runtime.model.quantize import QuantizedLinear, share_rows


class GpuBlockLinear(QuantizedLinear):
    """w = d * codes + m per group of `in_features / groups` inputs; `forward(x)` is x @ w.T."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, packed: bool = False) -> None:
        """`packed`: `codes` holds two 4-bit codes a byte (runtime.kernels.gpu.linear.pack_nibbles)."""
        super().__init__()
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * (2 if packed else 1)
        self.packed = packed
        self.register_buffer("weight", codes)
        self.register_buffer("d", d.float())
        self.register_buffer("m", None if m is None else m.float())
        self.bias = None

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        from runtime.kernels.gpu.linear import block_linear

        return block_linear(x, self.weight, self.d, self.m, self.packed)

    def dequantized(self) -> torch.Tensor:
        codes = self.weight
        if self.packed:
            codes = torch.stack((codes & 15, codes >> 4), dim=-1).reshape(self.out_features, self.in_features)
        groups = codes.reshape(*self.d.shape, -1).float() * self.d[..., None]
        if self.m is not None:
            groups = groups + self.m[..., None]
        return groups.reshape(self.out_features, self.in_features)

    @classmethod
    def concatenated(cls, layers: list["GpuBlockLinear"]) -> "GpuBlockLinear":
        """One layer computing `layers`' outputs side by side (each output from its own row's codes and
        scales only, so the same bits); the layers' buffers become views of its own."""
        m = None if layers[0].m is None else torch.cat([layer.m for layer in layers])
        fused = cls(torch.cat([layer.weight for layer in layers]), torch.cat([layer.d for layer in layers]), m,
                    layers[0].packed)
        share_rows(layers, fused, ("weight", "d", "m"))
        return fused

    @property
    def nbytes(self) -> int:
        """Bytes one call reads of the layer: codes and scales."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.d, self.m) if t is not None)
