"""A linear layer over a GGUF's own blocks (codes, d, m as runtime.model.gguf_blocks keeps them) computed on
a GPU by ponder's Triton block GEMM (runtime/kernels/gpu/linear.py): the file's weights, dequantized in
registers, each row's outputs its own bits whatever the batch.

Used by the device check's 4-bit figures (bench/gpu.py); the loader does not yet keep a GGUF's blocks on
a GPU (`quantize = "auto"` there still dequantizes to bf16). The codes are one byte each, as the CPU
kernels' layout keeps them before packing: a step reads 8 bits a weight plus the scales, not the
file's 4.5."""

from __future__ import annotations

import torch

from runtime.model.quantize import QuantizedLinear, share_rows


class GpuBlockLinear(QuantizedLinear):
    """w = d * codes + m per group of `in_features / groups` inputs; `forward(x)` is x @ w.T."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("weight", codes)
        self.register_buffer("d", d.float())
        self.register_buffer("m", None if m is None else m.float())
        self.bias = None

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        from runtime.kernels.gpu.linear import block_linear

        return block_linear(x, self.weight, self.d, self.m)

    def dequantized(self) -> torch.Tensor:
        groups = self.weight.reshape(*self.d.shape, -1).float() * self.d[..., None]
        if self.m is not None:
            groups = groups + self.m[..., None]
        return groups.reshape(self.weight.shape)

    @classmethod
    def concatenated(cls, layers: list["GpuBlockLinear"]) -> "GpuBlockLinear":
        """One layer computing `layers`' outputs side by side (each output from its own row's codes and
        scales only, so the same bits); the layers' buffers become views of its own."""
        m = None if layers[0].m is None else torch.cat([layer.m for layer in layers])
        fused = cls(torch.cat([layer.weight for layer in layers]), torch.cat([layer.d for layer in layers]), m)
        share_rows(layers, fused, ("weight", "d", "m"))
        return fused

    @property
    def nbytes(self) -> int:
        """Bytes one call reads of the layer: codes and scales."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.d, self.m) if t is not None)
