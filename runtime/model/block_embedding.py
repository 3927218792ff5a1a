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

A row's floats are computed from its own bytes only: they do not depend on the other ids of the step.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.model.block_pack import BLOCK_COLUMNS, unpack_codes, unpack_scales

_ROWS_AT_ONCE = 64  # rows decoded at a time: bounds the codes, scales and floats in flight on a long prompt


class BlockEmbedding(nn.Module):
    """`nn.Embedding`'s lookup over a GGUF tensor's own blocks of `kind` (a GGMLQuantizationType's name)."""

    def __init__(self, kind: str, blocks: torch.Tensor, embedding_dim: int, dtype: torch.dtype) -> None:
        from gguf import GGMLQuantizationType

        super().__init__()
        self.kind, self.dtype = kind, dtype
        self.qtype = GGMLQuantizationType[kind]
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding_dim
        self.register_buffer("blocks", blocks)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        from gguf.quants import dequantize

        ids = input_ids.reshape(-1)
        rows = torch.empty(ids.shape[0], self.embedding_dim, dtype=self.dtype)
        for start in range(0, ids.shape[0], _ROWS_AT_ONCE):
            chunk = ids[start:start + _ROWS_AT_ONCE]
            rows[start:start + chunk.shape[0]] = torch.from_numpy(dequantize(self.blocks[chunk].numpy(), self.qtype))
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind} blocks"


class HeadRowsEmbedding(nn.Module):
    """The lookup over the rows of the int layer `head` (runtime.model.quantize.Int4Linear) it is tied
    to: w = d * q + m per group, as `Int4Linear.dequantized` computes it, for the looked-up rows only."""

    def __init__(self, head: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.__dict__["head"] = head  # not a submodule: the head's buffers have one owner, the head
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        rows = torch.empty(ids.shape[0], self.embedding_dim, dtype=self.dtype)
        for start in range(0, ids.shape[0], _ROWS_AT_ONCE):
            chunk = ids[start:start + _ROWS_AT_ONCE]
            rows[start:start + chunk.shape[0]] = self._rows(chunk)
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head
        block, lane = ids // BLOCK_COLUMNS, ids % BLOCK_COLUMNS
        count = ids.shape[0] * BLOCK_COLUMNS  # each id's whole block of 8 columns is read back, then its own kept
        pick = torch.arange(ids.shape[0]) * BLOCK_COLUMNS + lane
        codes = unpack_codes(head.weight[block], head.bits, count, head.in_features)[pick]
        d = unpack_scales(head.d[block], count)[pick]
        m = None if head.m is None else unpack_scales(head.m[block], count)[pick]
        w = codes.reshape(ids.shape[0], d.shape[1], -1).float() * d[..., None]
        if m is not None:
            w = w + m[..., None]
        return w.reshape(ids.shape[0], self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, the tied head's blocks"


def embedding_dtype(embedding: nn.Module) -> torch.dtype:
    """The floats an embedding gives (the model's activations' type)."""
    return embedding.dtype if isinstance(embedding, (BlockEmbedding, HeadRowsEmbedding)) else embedding.weight.dtype
