"""The Triton GEMM with a fixed reduction order (runtime/kernels/gpu/linear.py) in Triton's interpreter:
float weights and a GGUF's own Q8_0 and Q4_K blocks against gguf's dequantized weights, and a row's bits
alone equal to its bits in a batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from runtime.kernels.gpu.linear import TILES, _launch, block_linear, linear, pack_nibbles, sum_order, unpack
from runtime.model.gguf_blocks import decode


def assert_rows_are_their_own(fn, x):
    batch = fn(x)
    for count in (1, 3, 17):
        assert torch.equal(fn(x[:count]), batch[:count])
    assert torch.equal(fn(x[5:6]), batch[5:6])
    return batch


# the default tile; the inputs split in three programs' worth, and in four of which two read nothing
@pytest.mark.parametrize("tile", [None, (8, 32, 4, 3), (16, 64, 4, 4)])
def test_float_linear_matches_torch_and_keeps_each_row_s_bits(tile):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(20, 96, generator=gen), torch.randn(40, 96, generator=gen)
    out = assert_rows_are_their_own(lambda rows: linear(rows, w) if tile is None else _launch(rows, w, None, None,
                                                                                               tile=tile), x)
    torch.testing.assert_close(out, x @ w.T, atol=1e-4, rtol=1e-4)


def q4_k_data(rows: int, cols: int) -> np.ndarray:
    """Random Q4_K blocks: 144 bytes per 256 weights, super-block d and dmin float16 values kept sane."""
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, (rows, cols // 256 * 144), dtype=np.uint8)
    blocks = data.reshape(rows, -1, 144)
    blocks[..., 0:4] = np.frombuffer(np.array(rng.uniform(0.001, 0.01, rows * cols // 256 * 2), np.float16)
                                     .tobytes(), np.uint8).reshape(rows, -1, 4)
    return data


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_block_linear_computes_with_the_file_s_own_weights(kind):
    if kind == "Q8_0":
        weights = (np.random.default_rng(0).standard_normal((40, 256)) * 0.3).astype(np.float32)
        data = quantize(weights, GGMLQuantizationType.Q8_0)
    else:
        data = q4_k_data(40, 256)
    blocks = decode(kind, data)
    dense = torch.from_numpy(dequantize(data, GGMLQuantizationType[kind]).copy())
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(2))
    out = assert_rows_are_their_own(lambda rows: block_linear(rows, blocks.codes, blocks.d, blocks.m), x)
    expected = x.double() @ dense.double().T
    torch.testing.assert_close(out.double(), expected, atol=1e-4 * float(expected.abs().max()), rtol=1e-4)
    if kind == "Q4_K":  # two codes a byte: the same weights, the same arithmetic, the same bits
        packed = pack_nibbles(blocks.codes)
        assert packed.shape == (40, 128)
        assert torch.equal(block_linear(x, packed, blocks.d, blocks.m, packed=True), out)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q3_K"])
def test_a_k_quant_s_scales_as_the_file_holds_them_give_the_products_bits(kind):
    """int8 sub-scales times float32 super-block scales, multiplied in the kernel, are gguf's float32
    products exactly: the same output bits as the products given, each row's alone as in a batch."""
    from tests.gguf_model import blocks_of

    blocks = decode(kind, blocks_of(kind, 40, 512, seed=4))
    d_super, sub_d, m_super, sub_m = blocks.compact
    assert sub_d.dtype == torch.int8 and d_super.shape == (40, 2)
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(5))
    products = block_linear(x, blocks.codes, blocks.d, blocks.m)
    held = assert_rows_are_their_own(lambda rows: block_linear(rows, blocks.codes, sub_d, sub_m,
                                                               supers=(d_super, m_super)), x)
    assert torch.equal(held, products)


@pytest.mark.parametrize("kind", ["Q6_K", "Q5_K", "Q5_0", "Q3_K"])
def test_codes_held_in_six_or_four_bits_give_the_byte_a_code_bits(kind):
    """Q6_K's and Q5's codes as a low nibble two a byte and two high bits four a byte (Q6_K's stored plus 32),
    Q3_K's as a nibble (plus 4): unpacked in integers in the kernel, the same output bits as the codes a
    byte each, and the layer's `dequantized()` gguf's weights."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from runtime.model.gpu_blocks import GpuBlockLinear
    from tests.gguf_model import blocks_of

    data = blocks_of(kind, 24, 512, seed=6)
    blocks = decode(kind, data)
    layer = GpuBlockLinear.from_blocks(blocks)
    assert layer.packed and (layer.high is not None) == (kind != "Q3_K")
    assert layer.offset == {"Q6_K": 32, "Q3_K": 4}.get(kind, 0)
    assert torch.equal(layer.dequantized(), torch.from_numpy(dequantize(data, GGMLQuantizationType[kind])))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(7))
    held = assert_rows_are_their_own(layer.rows, x)
    assert torch.equal(held, block_linear(x, blocks.codes, blocks.d, blocks.m))


def test_a_block_layer_fuses_and_computes_with_its_dequantized_weights():
    from runtime.model.projections import fuse_linears
    from runtime.model.gpu_blocks import GpuBlockLinear

    gen = torch.Generator().manual_seed(3)
    layers = [GpuBlockLinear(torch.randint(0, 16, (rows, 64), generator=gen, dtype=torch.uint8),
                             torch.rand(rows, 2, generator=gen), torch.randn(rows, 2, generator=gen))
              for rows in (32, 16)]
    x = torch.randn(3, 64, generator=gen)
    apart = [layer.rows(x) for layer in layers]
    torch.testing.assert_close(apart[0], x @ layers[0].dequantized().T, atol=1e-4, rtol=1e-4)
    fused = fuse_linears(layers)
    assert isinstance(fused, GpuBlockLinear) and fused.weight.shape == (48, 64)
    assert layers[1].weight.data_ptr() == fused.weight[32:].data_ptr()  # views: no memory added
    assert torch.equal(fused.rows(x), torch.cat(apart, dim=1))
    packed = GpuBlockLinear(pack_nibbles(layers[0].weight), layers[0].d, layers[0].m, packed=True)
    assert packed.in_features == 64 and torch.equal(packed.dequantized(), layers[0].dequantized())
    assert torch.equal(packed.rows(x), apart[0])


@pytest.mark.parametrize("tile", TILES)
def test_every_tile_the_sweep_times_computes_the_same_weights(tile):
    """Each tile the device check times (bench/gpu.py) computes x @ w.T over packed 4-bit blocks, and keeps
    a row's bits alone and in a batch; the weights' width not a whole number of chunks."""
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (24, 1088), generator=gen, dtype=torch.uint8)
    d = torch.rand(24, 1088 // 32, generator=gen) * 0.01
    m = -7.5 * d
    x = torch.randn(6, 1088, generator=gen)
    weights = (codes.float().reshape(24, -1, 32) * d[..., None] + m[..., None]).reshape(24, 1088)
    out = assert_rows_are_their_own(lambda rows: block_linear(rows, pack_nibbles(codes), d, m, packed=True,
                                                              tile=tile), x)
    if unpack(tile)[5]:  # (int8 inputs: the weights times the inputs as quantized)
        expected = (int8_inputs(x) @ weights.double().T).float()
    else:
        expected = x @ weights.T
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def int8_inputs(x: torch.Tensor) -> torch.Tensor:
    """x's rows as the int8 kernels quantize them, a group of 32 at a time (s * q, float64): top = max |x|,
    q = x * (127 / top) to the nearest integer, s = top / 127."""
    groups = x.float().reshape(x.shape[0], -1, 32)
    top = groups.abs().amax(-1, keepdim=True)
    q = torch.round(groups * torch.where(top > 0, 127.0 / top, torch.zeros_like(top)))
    return (q.double() * (top / 127.0).double()).reshape(x.shape)


INT8_TILES = [tile for tile in TILES if unpack(tile)[5]]


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "Q4_1", "Q3_K"])
def test_int8_inputs_give_a_row_the_same_bits_in_every_tile_of_one_sum_order(kind):
    """The int8 kernel over a layer's codes in the forms a GPU keeps them (packed, 6-bit, int8; groups of
    32 and of 16): gguf's weights times the inputs as quantized, within float32's rounding; a row's bits
    alone as in a batch; and the same bits from the GEMV and the tensor-core tile of one sum order, so a
    layer may take either at any row count."""
    from runtime.model.gpu_blocks import GpuBlockLinear
    from tests.gguf_model import blocks_of

    data = blocks_of(kind, 40, 512, seed=12)
    layer = GpuBlockLinear.from_blocks(decode(kind, data))
    dense = torch.from_numpy(dequantize(data, GGMLQuantizationType[kind]).copy())
    x = torch.randn(17, 512, generator=torch.Generator().manual_seed(13))
    expected = int8_inputs(x) @ dense.double().T
    by_order: dict[tuple, torch.Tensor] = {}
    for tile in (INT8_TILES[0], INT8_TILES[4], (16, 64, 4, 3, 1, 1), (16, 64, 4, 3, 16, 1)):  # (GEMV, tile; split)
        call = lambda rows: block_linear(rows, layer.weight, layer.d, layer.m, layer.packed, tile=tile,  # noqa: E731
                                         high=layer.high, offset=layer.offset,
                                         supers=None if layer.d_super is None else (layer.d_super, layer.m_super))
        out = call(x)
        torch.testing.assert_close(out.double(), expected, atol=1e-5 * float(expected.abs().max()), rtol=1e-5)
        assert torch.equal(call(x[16:17]), out[16:17]) and torch.equal(call(x[:3]), out[:3])
        assert torch.equal(by_order.setdefault(sum_order(tile, 512), out), out), tile
    assert len(by_order) == 2  # (one split; three of 192 inputs)


@pytest.fixture
def bf16_products(monkeypatch):
    """Triton's interpreter holds a bfloat16 as its 16 bits and multiplies those as integers in `tl.dot`:
    taught here to multiply their values (widened to float32, exactly), and the tile told to take
    bfloat16 operands on the CPU as it does on a GPU, so the bfloat16 path's loads, casts and masks run."""
    from triton.runtime import interpreter

    import runtime.kernels.gpu.linear as linear_module

    plain = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        import triton.language as tl

        def widened(t):
            if t.dtype.scalar != tl.bfloat16:
                return t
            data = interpreter._convert_float(t.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)

        return plain(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    monkeypatch.setattr(linear_module, "dot_type", lambda x, w: x.dtype if x.dtype == torch.bfloat16 else torch.float32)


TENSOR_TILES = [tile for tile in TILES if unpack(tile)[4] > 1 and not unpack(tile)[5]]


@pytest.mark.parametrize("operands", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
def test_a_tensor_core_tile_computes_the_file_s_weights_and_keeps_each_row_s_bits(kind, operands, request):
    """Sixteen rows a program, a group's codes times them in one `tl.dot` and then scaled: gguf's
    weights' products within float32's rounding, each row's bits alone as in a batch (rows 1, 3, 17 and
    20: one tile of rows and two), the layer's codes in the forms a GPU keeps them (packed, 6-bit, int8)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from runtime.model.gpu_blocks import GpuBlockLinear
    from tests.gguf_model import blocks_of

    if operands == "bfloat16":
        request.getfixturevalue("bf16_products")
    data = blocks_of(kind, 40, 512, seed=8)
    layer = GpuBlockLinear.from_blocks(decode(kind, data))
    dense = torch.from_numpy(dequantize(data, GGMLQuantizationType[kind]).copy())
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(9)).to(getattr(torch, operands))
    expected = x.double() @ dense.double().T
    for tile in (TENSOR_TILES[0], (16, 64, 4, 3, 16)):  # (three splits of 192 inputs: the last one short)
        out = assert_rows_are_their_own(lambda rows: block_linear(
            rows, layer.weight, layer.d, layer.m, layer.packed, tile=tile, high=layer.high, offset=layer.offset,
            supers=None if layer.d_super is None else (layer.d_super, layer.m_super)), x)
        tolerance = 1e-4 if operands == "float32" else 1e-2  # (a bfloat16 output's rounding)
        torch.testing.assert_close(out.double(), expected, atol=tolerance * float(expected.abs().max()), rtol=tolerance)


def test_a_tensor_core_tile_over_float_weights_matches_torch():
    gen = torch.Generator().manual_seed(10)
    x, w = torch.randn(18, 96, generator=gen), torch.randn(40, 96, generator=gen)
    out = assert_rows_are_their_own(lambda rows: _launch(rows, w, None, None, tile=(16, 32, 4, 2, 16)), x)
    torch.testing.assert_close(out, x @ w.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", [None, (16, 32, 4, 1, 16), (8, 32, 4, 1, 1, 1), (16, 64, 4, 1, 16, 1)])
def test_a_down_projection_computes_act_of_gate_times_up_as_it_loads_them(dtype, tile):
    """`act`: the block GEMM reads a fused gate/up output and computes SiLU(gate) * up (GELU's tanh form:
    Gemma's) as it loads its inputs: the same bits as elementwise.act_mul's launch and then the GEMM."""
    from runtime.kernels.gpu.elementwise import act_mul

    gen = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 16, (24, 96), generator=gen, dtype=torch.uint8)
    d = torch.rand(24, 3, generator=gen) * 0.01
    m = -7.5 * d
    gate_up = (torch.randn(18, 192, generator=gen) * 2).to(dtype)
    for act, gelu in ((1, False), (2, True)):
        apart = block_linear(act_mul(gate_up, 96, gelu=gelu), pack_nibbles(codes), d, m, packed=True, tile=tile)
        fused = assert_rows_are_their_own(lambda rows: block_linear(rows, pack_nibbles(codes), d, m, packed=True,
                                                                    tile=tile, act=act), gate_up)
        assert torch.equal(fused, apart)
