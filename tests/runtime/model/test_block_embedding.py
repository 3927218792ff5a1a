"""A GGUF's token embedding kept in its blocks (runtime.model.block_embedding): the rows looked up are
`gguf.dequantize`'s, type by type (bit for bit from the file's bytes, value for value from the int
layer of the head tied to it), and a row's bits do not depend on the other ids looked up with it."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from runtime.kernels.cpu_kernels import q4_unavailable
from runtime.model.block_embedding import BlockEmbedding, HeadRowsEmbedding, embedding_dtype
from runtime.model.gguf_blocks import SUPPORTED, decode
from tests.gguf_model import blocks_of

ROWS, WIDTH = 43, 512  # a last block of 8 head columns padded; two K-quant super-blocks a row
IDS = torch.tensor([[5, 0, 42, 5, 40], [17, 8, 7, 41, 1]])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def assert_same_values(a: torch.Tensor, b: torch.Tensor) -> None:
    """The same floats, a zero's sign aside (see the module's docstring)."""
    assert_same_bits(a + 0.0, b + 0.0)  # -0 + 0 is +0; every other value is unchanged


def file_rows(kind: str) -> tuple[np.ndarray, torch.Tensor]:
    data = blocks_of(kind, ROWS, WIDTH, seed=3)
    return data, torch.from_numpy(dequantize(data, GGMLQuantizationType[kind]))


def assert_looks_up_gguf_s_rows(embedding, expected: torch.Tensor, same=assert_same_bits) -> None:
    same(embedding(IDS), expected[IDS])
    many = torch.randint(0, ROWS, (150,), generator=torch.Generator().manual_seed(0))  # more than one chunk
    crowd = embedding(many)
    same(crowd, expected[many])
    for i in (0, 1, 70, 149):  # alone, the same bits as in the crowd
        assert_same_bits(embedding(many[i:i + 1]), crowd[i:i + 1])


@pytest.mark.parametrize("kind", [*SUPPORTED, "IQ2_XXS"])  # and a type no kernel of ponder's runs
def test_an_embedding_kept_in_the_file_s_blocks_gives_gguf_s_rows(kind):
    data, expected = file_rows(kind)
    embedding = BlockEmbedding(kind, torch.from_numpy(data), WIDTH, torch.float32)
    assert embedding.blocks.dtype == torch.uint8 and embedding.blocks.nbytes == data.nbytes  # the file's bytes
    assert embedding_dtype(embedding) == torch.float32
    assert_looks_up_gguf_s_rows(embedding, expected)


@pytest.mark.skipif(q4_unavailable() is not None, reason="int layers need ponder's CPU kernel")
@pytest.mark.parametrize("kind", SUPPORTED)
def test_a_tied_embedding_reads_gguf_s_rows_back_from_the_head_s_int_layer(kind):
    from runtime.model.quantize import Int4Linear

    data, expected = file_rows(kind)
    head = Int4Linear.from_blocks(decode(kind, data))
    embedding = HeadRowsEmbedding(head, torch.float32)
    assert not list(embedding.parameters()) and not list(embedding.buffers())  # the head's, held once
    assert_looks_up_gguf_s_rows(embedding, expected, assert_same_values)


def test_a_bfloat16_model_s_rows_are_gguf_s_rounded_once():
    data, expected = file_rows("Q4_K")
    embedding = BlockEmbedding("Q4_K", torch.from_numpy(data), WIDTH, torch.bfloat16)
    assert torch.equal(embedding(IDS), expected[IDS].to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_s_scaled_embedding_kept_in_blocks_gives_its_scaled_rows(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from runtime.model.block_embedding import row_scale

    data, expected = file_rows("Q4_K")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as transformers makes a model of `dtype`: the scale's buffer in it too
    try:
        gemma = Gemma3TextScaledWordEmbedding(ROWS, WIDTH, 0, embed_scale=WIDTH ** 0.5)  # 22.627..., not exact
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        gemma.weight.copy_(expected)
    scale = row_scale(gemma)
    assert gemma.embed_scale.dtype == dtype and torch.equal(scale.to(dtype), gemma.embed_scale)
    assert row_scale(torch.nn.Embedding(2, 2)) is None
    embedding = BlockEmbedding("Q4_K", torch.from_numpy(data), WIDTH, dtype, scale)
    assert "rows times 22.6274" in repr(embedding)
    with torch.no_grad():
        assert torch.equal(embedding(IDS), gemma(IDS))  # transformers' product, in the model's dtype
        assert not torch.equal(embedding(IDS), BlockEmbedding("Q4_K", torch.from_numpy(data), WIDTH, dtype)(IDS))
    if dtype is torch.float32 and q4_unavailable() is None:
        from runtime.model.quantize import Int4Linear

        tied = HeadRowsEmbedding(Int4Linear.from_blocks(decode("Q4_K", data)), dtype, scale)
        with torch.no_grad():
            assert_same_values(tied(IDS), gemma(IDS))
