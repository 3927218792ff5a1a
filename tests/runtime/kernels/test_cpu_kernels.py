import pytest
import torch
from torch import nn

from runtime.kernels.cpu_kernels import describe_isa, q4_kernel, q4_unavailable, use_isa
from runtime.model.quantize import Int4Linear

pytestmark = pytest.mark.skipif(q4_unavailable() is not None, reason="ponder's int4 kernel needs an x86-64 CPU with AVX2")


def random_layer(out_features=40, in_features=96, zero_points=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=g)
    d = (torch.rand(out_features, in_features // 32, generator=g) * 0.02 + 0.001).half().float()
    m = (torch.randn(out_features, in_features // 32, generator=g) * 0.05).half().float() if zero_points else None
    return Int4Linear(codes, d, m), codes, d, m


def test_exact_activations_give_the_exact_product():
    # Integer activations whose every group reaches 127 quantize exactly (scale 1), and with d and m
    # powers of two every partial sum is exact in float32: the result must equal float64's bit for bit,
    # which pins the code order in the bytes, the group offsets and the zero points.
    layer, codes, _, _ = random_layer()
    layer.d.fill_(2 ** -4)
    layer.m.fill_(-(2 ** -1))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-127, 128, (7, 96), generator=g).float()
    x[:, ::32] = 127
    weights = codes.double() * 2 ** -4 - 2 ** -1
    assert torch.equal(layer(x).double(), x.double() @ weights.T)
    assert torch.equal(layer.dequantized().double(), weights)


@pytest.mark.parametrize("sign", [1, -1])
def test_the_largest_sums_do_not_saturate(sign):
    # Every code 15 against every activation +-127: the largest group sum the kernel can meet (AVX2 keeps
    # a group's partial sums in int16 lanes, up to 8 * 2 * 15 * 127 = 30480), still exact.
    layer, codes, _, _ = random_layer()
    codes.fill_(15)
    layer = Int4Linear(codes, torch.full((40, 3), 2 ** -4), torch.full((40, 3), -(2 ** -1)))
    x = torch.full((3, 96), 127.0 * sign)
    assert torch.equal(layer(x).double(), x.double() @ (codes.double() * 2 ** -4 - 2 ** -1).T)


def test_the_product_is_close_to_float_with_quantized_activations():
    layer, *_ = random_layer(out_features=70, in_features=192)
    x = torch.randn(5, 192, generator=torch.Generator().manual_seed(1))  # not whatever earlier tests left
    exact = x.double() @ layer.dequantized().double().T
    error = (layer(x).double() - exact).abs().max() / exact.abs().max()
    assert 0 < error < 0.01  # int8 activations: about 1/254 of a group's largest value per element


def test_a_row_gets_the_same_bits_alone_in_any_batch_and_in_both_instruction_sets():
    layer, *_ = random_layer(out_features=50, in_features=128)
    x = torch.randn(11, 128) * torch.linspace(0.01, 100, 11)[:, None]
    kernel = q4_kernel()
    full = layer(x)
    for rows in range(1, 12):  # every tile remainder
        assert torch.equal(layer(x[:rows]), full[:rows])
    for i in range(11):
        assert torch.equal(layer(x[i:i + 1]), full[i:i + 1])
    avx2 = kernel(x, layer.weight, layer.d, layer.m, 50, None, 0.0, None, 0)
    assert torch.equal(avx2, full)
    if torch.ops.ponder.q4_best_isa() == 1:
        assert torch.equal(kernel(x, layer.weight, layer.d, layer.m, 50, None, 0.0, None, 1), full)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), full)
    finally:
        torch.set_num_threads(threads)


def test_the_cpu_isa_setting_keeps_the_kernel_on_avx2_with_the_same_bits():
    layer, *_ = random_layer(out_features=50, in_features=128)
    x = torch.randn(11, 128, generator=torch.Generator().manual_seed(2))
    best = describe_isa()
    full = layer(x)
    try:
        assert use_isa("avx2") == "AVX2" == describe_isa()
        assert torch.equal(layer(x), full)
        assert torch.ops.ponder.q4_best_isa() == 0
    finally:
        assert use_isa("auto") == best
    assert torch.ops.ponder.q4_best_isa() == {"AVX2": 0, "AVX512-VNNI": 1}[best]
    with pytest.raises(ValueError, match="cpu_isa = 'avx512' is not one of auto, avx2"):
        use_isa("avx512")
    with pytest.raises(RuntimeError, match="0 .AVX2. or 1"):
        torch.ops.ponder.q4_limit_isa(2)


def test_the_norm_before_and_the_residual_after_are_the_layers_own():
    layer, *_ = random_layer(out_features=64, in_features=96, zero_points=False)
    x, residual = torch.randn(6, 96) * 3, torch.randn(6, 64)
    weight, eps = torch.rand(96) + 0.5, 1e-5
    normed = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    fused = layer.fused_rows(x, weight, eps, residual)
    assert torch.allclose(fused, residual + layer(normed), rtol=0, atol=1e-4)
    assert torch.equal(layer.fused_rows(x, residual=residual), residual + layer(x))  # the same float add
    assert torch.equal(layer.fused_rows(x[2:3], weight, eps, residual[2:3]), fused[2:3])


def test_a_zero_row_and_q4_0_layers():
    layer, codes, d, _ = random_layer(zero_points=False)
    assert layer.m is None
    assert torch.equal(layer(torch.zeros(2, 96)), torch.zeros(2, 40))
    assert torch.equal(layer.dequantized(), codes.float() * d.repeat_interleave(32, dim=1))


def test_from_linear_keeps_each_group_within_half_a_step():
    linear = nn.Linear(64, 24)
    layer = Int4Linear.from_linear(linear)
    step = layer.group_scales()[0].repeat_interleave(32, dim=1)
    error = (layer.dequantized() - linear.weight.detach()).abs()
    assert (error <= step / 2 + 1e-3 * linear.weight.detach().abs().max()).all()  # + the float16 rounding of m


def test_bad_shapes_are_refused():
    layer, *_ = random_layer()
    with pytest.raises(RuntimeError, match="x must be float32"):
        q4_kernel()(torch.randn(2, 96, dtype=torch.float64), layer.weight, layer.d, layer.m, 40)
    with pytest.raises(RuntimeError, match="codes must be contiguous uint8"):
        q4_kernel()(torch.randn(2, 64), layer.weight, layer.d, layer.m, 40)
    with pytest.raises(RuntimeError, match="41 outputs do not fill 5 blocks of 8"):
        q4_kernel()(torch.randn(2, 96), layer.weight, layer.d, layer.m, 41)
    with pytest.raises(RuntimeError, match=r"d must be contiguous float16, float32 or uint8 \(K-quant scales\)"):
        q4_kernel()(torch.randn(2, 96), layer.weight, layer.d[:, :2], layer.m, 40)
    with pytest.raises(RuntimeError, match=r"d must be \[out / 8, in / 32, 8\]"):
        q4_kernel()(torch.randn(2, 96), layer.weight, layer.d[:, :2].contiguous(), layer.m, 40)
    with pytest.raises(RuntimeError, match=r"m must be contiguous, of d's shape and dtype"):
        q4_kernel()(torch.randn(2, 96), layer.weight, layer.d, layer.m.float(), 40)
    with pytest.raises(RuntimeError, match=r"codes must be contiguous uint8 \[out / 8, 4, 5 or 8 times in\]"):
        q4_kernel()(torch.randn(2, 96), layer.weight[:, :-32].contiguous(), layer.d, layer.m, 40)


@pytest.mark.parametrize("out_features", [8, 13, 40])
def test_the_kernel_layout_keeps_every_code_and_scale(out_features):
    layer, codes, d, m = random_layer(out_features=out_features, in_features=64)
    assert layer.weight.shape == (-(-out_features // 8), 4 * 64)  # a partial last block is padded
    assert torch.equal(layer.codes(), codes.to(torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(layer.group_scales(), (d, m)))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    assert layer(x).shape == (3, out_features)
    exact = x.double() @ layer.dequantized().double().T
    assert (layer(x).double() - exact).abs().max() < 0.03 * exact.abs().max()  # int8 activations


def test_only_whole_blocks_of_columns_concatenate_before_the_last_layer():
    parts = [random_layer(out_features=n, in_features=64, seed=n)[0] for n in (16, 13)]
    x = torch.randn(5, 64)
    fused = Int4Linear.concatenated(parts)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    assert Int4Linear.concatenated(parts[::-1]) is None  # 13 columns would leave a gap before the next layer
