"""Every GGUF block type the int kernel runs, against a reference that is not ponder's: the `gguf`
package's own `dequantize` followed by a float64 matmul.

The blocks come from `gguf`'s quantizers where it has them (MXFP4's among them); for the types it only dequantizes
(K-quants, IQ4_NL, IQ4_XS), they are random bytes in the type's block layout with float16 super-block scales
in a sane range, every byte pattern of codes and sub-scales being a valid block, and what they stand
for is defined by `gguf.dequantize` (checked bit for bit against ponder's decoding first)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from runtime.kernels.cpu_kernels import q4_unavailable
from runtime.model.gguf_blocks import SUPPORTED, Blocks, decode
from runtime.model.quantize import Int4Linear
from tests.gguf_model import SCALE_OFFSETS as _SCALE_OFFSETS
from tests.gguf_model import blocks_of

pytestmark = pytest.mark.skipif(q4_unavailable() is not None, reason="ponder's int kernel needs an x86-64 CPU with AVX2")

def test_gguf_quantizes_every_type_it_can():
    # The types the helper fills with random blocks are exactly those gguf cannot quantize.
    for kind in SUPPORTED:
        if kind in _SCALE_OFFSETS:
            with pytest.raises(NotImplementedError):
                quantize(np.zeros((1, 256), np.float32), GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", SUPPORTED)
def test_blocks_decode_to_what_gguf_dequantizes_bit_for_bit(kind):
    data = blocks_of(kind, 24, 512)
    blocks = decode(kind, data)
    assert blocks.codes.shape == (24, 512)
    assert torch.equal(blocks.dequantized(), torch.from_numpy(dequantize(data, GGMLQuantizationType[kind])))
    layer = Int4Linear.from_blocks(blocks)
    assert torch.equal(layer.codes(), blocks.codes)  # the kernel's layout reads back to the file's codes
    assert torch.equal(layer.dequantized(), blocks.dequantized())


@pytest.mark.parametrize("kind", SUPPORTED)
def test_the_kernel_matches_gguf_dequantize_and_a_float64_matmul(kind):
    data = blocks_of(kind, 70, 768, seed=1)
    layer = Int4Linear.from_blocks(decode(kind, data))
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(1))
    exact = x.double() @ torch.from_numpy(dequantize(data, GGMLQuantizationType[kind])).double().T
    y = layer(x)
    error = ((y.double() - exact).abs().max() / exact.abs().max()).item()
    assert 0 < error < 0.01  # int8 activations: about 1/254 of a group's largest value per element
    assert torch.equal(layer.kernel(x, layer.weight, layer.d, layer.m, 70, None, 0.0, None, 0), y)  # AVX2
    if torch.ops.ponder.q4_best_isa() == 1:
        assert torch.equal(layer.kernel(x, layer.weight, layer.d, layer.m, 70, None, 0.0, None, 1), y)


@pytest.mark.parametrize("kind", SUPPORTED)
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(kind):
    layer = Int4Linear.from_blocks(decode(kind, blocks_of(kind, 50, 256, seed=2)))
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.01, 100, 11)[:, None]
    full = layer(x)
    for rows in range(1, 12):  # every tile remainder on both instruction sets' tile heights
        assert torch.equal(layer(x[:rows]), full[:rows])
    for i in range(11):
        assert torch.equal(layer(x[i:i + 1]), full[i:i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("code,kind", [(31, "Q5_1"), (127, "Q8_0"), (-128, "Q8_0"), (-32, "Q6_K")])
@pytest.mark.parametrize("sign", [1, -1])
def test_the_largest_sums_do_not_saturate(code, kind, sign):
    # Every code at its extreme against every activation +-127 (AVX2 sums products in int16 lanes, 8-bit
    # codes' pairs up to 2 * 128 * 127 = 32512), with power-of-two scales: exact, both instruction sets.
    out, cols = 24, 128
    codes = torch.full((out, cols), code, dtype=torch.int8 if code < 0 or code > 31 or kind == "Q6_K" else torch.uint8)
    groups = cols // (16 if kind == "Q6_K" else 32)
    d = torch.full((out, groups), 2.0 ** -4)
    m = torch.full((out, groups), -0.5) if kind == "Q5_1" else None
    layer = Int4Linear.from_blocks(Blocks(kind, codes, d, m))
    x = torch.full((3, cols), 127.0 * sign)
    exact = x.double() @ Blocks(kind, codes, d, m).dequantized().double().T
    for isa in (0, 1) if torch.ops.ponder.q4_best_isa() == 1 else (0,):
        assert torch.equal(layer.kernel(x, layer.weight, layer.d, layer.m, out, None, 0.0, None, isa).double(), exact)


@pytest.mark.parametrize("kinds", [("Q5_0", "Q5_1", "Q8_0"), ("Q4_0", "Q8_0"), ("Q4_K", "Q5_K", "IQ4_NL", "Q4_1"),
                                   ("Q6_K", "Q6_K"), ("Q2_K", "Q3_K", "Q6_K"), ("Q2_K", "Q2_K")])
def test_layers_of_different_formats_fuse_with_every_output_s_bits_kept(kinds):
    layers = [Int4Linear.from_blocks(decode(kind, blocks_of(kind, 16 * (i + 1), 256, seed=i))) for i, kind in enumerate(kinds)]
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(5))
    alone = [layer(x) for layer in layers]
    fused = Int4Linear.concatenated(layers)
    assert torch.equal(fused(x), torch.cat(alone, dim=-1))
    for layer, y in zip(layers, alone):  # each layer, now a view of the fused buffers, gives its bits too
        assert torch.equal(layer(x), y)
    assert all(layer.weight.data_ptr() >= fused.weight.data_ptr() for layer in layers)


def test_scales_per_16_and_per_32_are_not_fused():
    q6 = Int4Linear.from_blocks(decode("Q6_K", blocks_of("Q6_K", 16, 256)))
    q4 = Int4Linear.from_blocks(decode("Q4_K", blocks_of("Q4_K", 16, 256)))
    assert Int4Linear.concatenated([q6, q4]) is None


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_k_quant_scales_kept_as_the_file_holds_them_give_the_float32_scales_bits(kind):
    # The kernel multiplies a super-block's float16 scale by the int8 sub-scale on the fly: the same
    # float32 values as the products stored whole, in under a third of the bytes.
    blocks = decode(kind, blocks_of(kind, 40, 512, seed=6))
    compact = Int4Linear.from_blocks(blocks)
    whole = Int4Linear.from_blocks(Blocks(kind, blocks.codes, blocks.d, blocks.m))
    assert compact.d.dtype == torch.uint8 and whole.d.dtype == torch.float32
    assert compact.d.numel() * 3 < whole.d.numel() * 4
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(7))
    assert torch.equal(compact(x), whole(x))
    assert torch.equal(compact.dequantized(), whole.dequantized())


@pytest.mark.skipif(torch.ops.ponder.q4_best_isa() != 1, reason="the two-block tiles are AVX512-VNNI's")
@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "MXFP4"])
def test_two_blocks_a_tile_give_each_column_the_bits_of_one_block_a_tile(kind):
    # AVX512-VNNI computes two blocks of 8 columns side by side (the AVX2 path one): every column count
    # (a partial last block alone or second in a pair) and every split between threads (which decides
    # the pairs) must give the AVX2 path's bits.
    for out_features in (8, 12, 16, 24, 60, 68):
        layer = Int4Linear.from_blocks(decode(kind, blocks_of(kind, out_features, 256, seed=out_features)))
        x = torch.randn(13, 256, generator=torch.Generator().manual_seed(4)) * 3
        avx2 = layer.kernel(x, layer.weight, layer.d, layer.m, out_features, None, 0.0, None, 0)
        threads = torch.get_num_threads()
        try:
            for count in (1, 2, 3):
                torch.set_num_threads(count)
                assert torch.equal(layer.kernel(x, layer.weight, layer.d, layer.m, out_features, None, 0.0, None, 1),
                                   avx2), (out_features, count)
        finally:
            torch.set_num_threads(threads)
