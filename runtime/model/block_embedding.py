"""A GGUF's token embedding kept in its blocks: the rows a step looks up are dequantized on lookup, as
llama.cpp's get_rows does, instead of the whole table widened to float32 at load (SmolLM2's 49152 x
576 table is 4.5x its Q6_K bytes as float32, a 262k-row vocabulary 2.4 GB).

- `BlockEmbedding` holds the tensor's bytes as the file stores them (`blocks` [rows, row bytes] uint8:
  the file's bytes exactly) and gives the looked-up rows as `gguf.dequantize` computes them from those
  bytes, bit for bit (any quantized type gguf reads, not only those the int kernel runs);
- `HeadRowsEmbedding` is the embedding of a head tied to it: the head's int layer already holds the
  same blocks in the kernel's layout, so the embedding holds nothing of its own and reads its rows
  back from the head's codes and scales (runtime.model.block_pack) as d * q + m: `gguf.dequantize`'s
  values (tested type by type), where a zero may have the other sign (Q4_0's d * (q - 8) is -0 for a
  negative d, d * q - 8 d is +0), which no sum, product or norm after it can tell apart.

Both take Gemma's scaled embeddings too (`SCALED`: transformers' `* embed_scale.to(weight.dtype)` after
the lookup, the same product here). A row's floats are computed from its own bytes only: they do not
depend on the other ids of the step.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from runtime.model.block_pack import BLOCK_COLUMNS, GROUP_SIZE

_ROWS_AT_ONCE = 64  # rows decoded at a time: bounds the codes, scales and floats in flight on a long prompt
# transformers' embeddings whose forward is the lookup times `embed_scale.to(weight.dtype)`, and nothing else
SCALED = ("GemmaTextScaledWordEmbedding", "Gemma2TextScaledWordEmbedding", "Gemma3TextScaledWordEmbedding",
          "Gemma4TextScaledWordEmbedding")


def row_scale(embedding: nn.Module) -> torch.Tensor | None:
    """The scale a `SCALED` embedding multiplies its rows by (None: a plain `nn.Embedding`), as the float
    its buffer is made from (float64): transformers makes the buffer in the model's dtype, and the lookup
    rounds this to it likewise (the module may be a skeleton on the meta device, its buffer unread)."""
    return torch.tensor(embedding.scalar_embed_scale, dtype=torch.float64) if type(embedding).__name__ in SCALED else None


class BlockEmbedding(nn.Module):
    """`nn.Embedding`'s lookup over a GGUF tensor's own blocks of `kind` (a GGMLQuantizationType's name)."""

    def __init__(self, kind: str, blocks: torch.Tensor, embedding_dim: int, dtype: torch.dtype,
                 scale: torch.Tensor | None = None) -> None:
        from gguf import GGMLQuantizationType

        super().__init__()
        self.kind, self.dtype, self.scale = kind, dtype, scale
        self.qtype = GGMLQuantizationType[kind]
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding_dim
        self.register_buffer("blocks", blocks)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        from gguf.quants import dequantize

        return _looked_up(input_ids, self.embedding_dim, self.dtype,
                          lambda ids: dequantize(self.blocks.numpy()[ids], self.qtype), self.scale)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind} blocks" + _scaled(self.scale)


class HeadRowsEmbedding(nn.Module):
    """The lookup over the rows of the int layer `head` (runtime.model.quantize.Int4Linear) it is tied
    to: w = d * q + m per group, as `Int4Linear.dequantized` computes it, for the looked-up rows only
    (each read from its lane of its block of 8 columns in the kernel's layout, runtime.model.block_pack)."""

    def __init__(self, head: nn.Module, dtype: torch.dtype, scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.__dict__["head"] = head  # not a submodule: the head's buffers have one owner, the head
        self.dtype, self.scale = dtype, scale
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return _looked_up(input_ids, self.embedding_dim, self.dtype, self._rows, self.scale)

    def _rows(self, ids: np.ndarray) -> np.ndarray:
        head = self.head
        block, lane = ids // BLOCK_COLUMNS, ids % BLOCK_COLUMNS
        codes = _lane_codes(head.weight.numpy()[block], lane, head.bits, head.in_features)
        d = _lane_scales(head.d.numpy()[block], lane)
        w = codes.reshape(len(ids), d.shape[1], -1).astype(np.float32) * d[..., None]
        if head.m is not None:
            w = w + _lane_scales(head.m.numpy()[block], lane)[..., None]
        return w.reshape(len(ids), -1)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, the tied head's blocks" + _scaled(self.scale)


def _scaled(scale: torch.Tensor | None) -> str:
    return "" if scale is None else f", rows times {scale.item():g}"


def _looked_up(input_ids: torch.Tensor, width: int, dtype: torch.dtype, rows, scale: torch.Tensor | None) -> torch.Tensor:
    """`rows(ids)` (float32 [n, width] numpy) for every id, a chunk of ids at a time, in `dtype`, times
    `scale` rounded to `dtype` where there is one (Gemma's). In numpy: the lookup of a decode step is a few rows,
    too little work for torch's threads to be worth waking."""
    ids = input_ids.reshape(-1).numpy()
    out = np.empty((len(ids), width), np.float32)
    for start in range(0, len(ids), _ROWS_AT_ONCE):
        out[start:start + _ROWS_AT_ONCE] = rows(ids[start:start + _ROWS_AT_ONCE])
    looked_up = torch.from_numpy(out).to(dtype).reshape(*input_ids.shape, width)
    return looked_up if scale is None else looked_up * scale.to(dtype)


def _lane_codes(packed: np.ndarray, lane: np.ndarray, bits: int, in_features: int) -> np.ndarray:
    """Column `lane` of each of `packed`'s blocks [n, bytes] (block_pack.pack_codes' layout): [n, in] codes."""
    n, groups, picked = packed.shape[0], in_features // GROUP_SIZE, np.arange(packed.shape[0])
    if bits == 8:  # block, group, chunk, half, lane, byte
        lanes = packed.reshape(n, groups, 4, 2, BLOCK_COLUMNS, 4).transpose(0, 4, 1, 2, 3, 5)
        return lanes[picked, lane].reshape(n, in_features).view(np.int8)
    per_group = packed.reshape(n, groups, -1)
    raw = per_group[..., :128].reshape(n, groups, 4, BLOCK_COLUMNS, 4).transpose(0, 3, 1, 2, 4)[picked, lane]
    codes = np.stack([raw & 0x0F, raw >> 4], axis=-2)  # n, group, chunk, half, byte
    if bits == 5:  # column j's 4 bytes a group; bit 8t + 2c + h of byte t is code (chunk c, half h, byte t)'s fifth
        high = per_group[..., 128:].reshape(n, groups, BLOCK_COLUMNS, 4).transpose(0, 2, 1, 3)[picked, lane]
        bit = (high[..., None] >> np.arange(8, dtype=np.uint8)) & 1  # n, group, t, (chunk, half)
        codes = codes | (bit.reshape(n, groups, 4, 4, 2).transpose(0, 1, 3, 4, 2) << 4)
    return codes.reshape(n, in_features)


def _lane_scales(v: np.ndarray, lane: np.ndarray) -> np.ndarray:
    """Column `lane` of each of the blocks `v` (block_pack.pack_scales' or pack_compact's form) as
    float32 [n, groups]: unpack_scales' values."""
    picked = np.arange(v.shape[0])
    if v.dtype != np.uint8:
        return v[picked, :, lane].astype(np.float32)
    supers = v.shape[1]
    head = np.ascontiguousarray(v[..., :16]).view(np.float16).astype(np.float32)[picked, :, lane]  # n, supers
    sub = np.ascontiguousarray(v[..., 16:]).view(np.int8).reshape(v.shape[0], supers, -1, BLOCK_COLUMNS)
    return (head[:, :, None] * sub[picked, :, :, lane].astype(np.float32)).reshape(v.shape[0], -1)


def embedding_dtype(embedding: nn.Module) -> torch.dtype:
    """The floats an embedding gives (the model's activations' type)."""
    return embedding.dtype if isinstance(embedding, (BlockEmbedding, HeadRowsEmbedding)) else embedding.weight.dtype
