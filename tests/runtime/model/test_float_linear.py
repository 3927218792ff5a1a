"""ponder's float kernel (runtime/kernels/csrc/float_linear.cpp, `FloatLinear` in runtime.model.float_layers): float32, bfloat16
and float16 weights as nn.Linear (or a GGUF) holds them, every output summed in one fixed order, so a row's bits never depend
on the batch, the thread count or the instruction set."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime.kernels.cpu_kernels import KernelUnavailable, float_kernel
from runtime.model.projections import fuse_linears
from runtime.model.float_layers import FloatLinear, float_layers
from runtime.model.quantize import apply_quantize

try:
    float_kernel()
    OP = torch.ops.ponder.float_linear.default
except KernelUnavailable as exc:  # pragma: no cover - every CI machine is x86-64 with AVX2
    pytest.skip(str(exc), allow_module_level=True)

HAS_AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
ISAS = (0, 1) if HAS_AVX512 else (0,)
SHAPES = [(37, 48), (1536, 576), (576, 1536)]  # a column tail, and SmolLM2's gate/up and down


def operands(n: int, k: int, dtype: torch.dtype, rows: int = 70, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator).to(dtype)
    return torch.randn(rows, k, generator=generator), weight, torch.randn(n, generator=generator)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_outputs_match_a_float64_product(n, k, dtype):
    x, weight, bias = operands(n, k, dtype)
    reference = x.double() @ weight.double().T + bias.double()
    for isa in ISAS:
        for b in (bias, None):
            y = OP(x, weight, b, isa)
            want = reference if b is not None else reference - bias.double()
            # float32 sums of k products of unit normals: an error of a few ulps of sqrt(k)
            assert (y.double() - want).abs().max().item() < 2e-6 * k ** 0.5 * 8


def test_exact_where_every_product_and_sum_is_exact():
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(-8, 9, (9, 64), generator=generator).float()
    weight = torch.randint(-8, 9, (21, 64), generator=generator).float()
    bias = torch.randint(-8, 9, (21,), generator=generator).float()
    for isa in ISAS:
        assert torch.equal(OP(x, weight, bias, isa), x @ weight.T + bias)
        assert torch.equal(OP(x, weight.bfloat16(), bias, isa), x @ weight.T + bias)
        assert torch.equal(OP(x, weight.half(), bias, isa), x @ weight.T + bias)


@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16])
def test_narrow_weights_give_the_bits_of_the_float32_weights_of_their_values(narrow):
    # float16 subnormals (below 6.1e-5) and its largest values widen exactly too
    x, weight, bias = operands(200, 96, narrow, rows=9, seed=3)
    if narrow == torch.float16:
        weight[0, :8] = torch.tensor([6e-8, -6e-8, 3e-5, -4e-5, 65504, -65504, 1e-7, 0.0]).half()
    wide = weight.float()
    for isa in ISAS:
        assert torch.equal(OP(x, weight, bias, isa), OP(x, wide, bias, isa))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_row_has_the_same_bits_alone_in_any_batch_on_any_path(n, k, dtype):
    x, weight, bias = operands(n, k, dtype)
    whole = OP(x, weight, bias, ISAS[-1])
    for isa in ISAS:
        assert torch.equal(OP(x, weight, bias, isa), whole)
        assert torch.equal(torch.cat([OP(x[i:i + 1], weight, bias, isa) for i in range(len(x))]), whole)
        for rows in (2, 3, 5, 13, 64, 65):
            assert torch.equal(OP(x[:rows], weight, bias, isa), whole[:rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(OP(x, weight, bias, -1), whole)
    finally:
        torch.set_num_threads(threads)


def test_fused_layers_give_each_column_its_own_bits():
    torch.manual_seed(0)
    layers = [nn.Linear(64, n, bias=True) for n in (24, 40, 8)]
    x = torch.randn(5, 64)
    separate = [FloatLinear(layer) for layer in layers]
    alone = torch.cat([layer.rows(x) for layer in separate], dim=-1)
    fused = fuse_linears(separate)
    assert isinstance(fused, FloatLinear) and fused.out_features == 72
    assert torch.equal(fused.rows(x), alone)
    assert separate[1].weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()


def test_a_bfloat16_layer_computes_in_float32_and_rounds_once():
    torch.manual_seed(0)
    linear = nn.Linear(96, 33).to(torch.bfloat16)
    x = torch.randn(4, 96).to(torch.bfloat16)
    y = FloatLinear(linear).rows(x)
    assert y.dtype == torch.bfloat16
    exact = x.double() @ linear.weight.double().T + linear.bias.double()
    assert torch.equal(y, exact.float().to(torch.bfloat16)) or \
        (y.double() - exact).abs().max().item() <= 2 ** -7 * exact.abs().max().item()
    assert (y.float() - F.linear(x, linear.weight, linear.bias).float()).abs().max().item() < 0.1


def test_auto_runs_a_float_model_s_layers_in_the_kernel_and_keeps_a_tied_head_tied(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    ids = torch.tensor([[1, 5, 9, 3]])
    before = model(ids).logits
    assert apply_quantize(model, "auto").mode == "none"  # no GGUF: float_layers decides
    quantized = float_layers(model)
    assert quantized.mode == "float" and quantized.layers == 15
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (model(ids).logits - before).abs().max().item() < 1e-4


def test_none_keeps_torch_s_layers(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert apply_quantize(model, "none").mode == "none"
    assert any(type(m) is nn.Linear for m in model.modules())


def test_float32_weights_of_bfloat16_values_are_read_as_bfloat16_with_the_same_bits():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    linear.weight.data = linear.weight.data.to(torch.bfloat16).float()  # a bfloat16 checkpoint loaded as float32
    x = torch.randn(7, 64)
    layer = FloatLinear(linear)
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.nbytes == linear.weight.nbytes // 2
    assert torch.equal(layer.rows(x), OP(x, linear.weight.detach(), linear.bias.detach(), -1))
    other = nn.Linear(64, 48)  # float32 values: kept as they are, not copied
    assert FloatLinear(other).weight.data_ptr() == other.weight.data_ptr()


def test_float32_weights_of_float16_values_are_read_as_float16_with_the_same_bits():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    linear.weight.data = linear.weight.data.half().float()  # a float16 checkpoint loaded as float32
    assert not torch.equal(linear.weight.data.bfloat16().float(), linear.weight.data)
    x = torch.randn(7, 64)
    layer = FloatLinear(linear)
    assert layer.weight.dtype == torch.float16
    assert torch.equal(layer.rows(x), OP(x, linear.weight.detach(), linear.bias.detach(), -1))


def test_the_start_up_line_says_a_bfloat16_checkpoint_s_weights_stay_bfloat16(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    model.to(torch.float32)
    quantized = float_layers(model)
    assert quantized.detail == ("15 layers in ponder's float kernel "
                                "(15 bfloat16 (float32 weights of bfloat16 values, kept as bfloat16))")


def test_a_model_run_wholly_by_ponder_s_kernels_pads_no_step(tiny_llama):
    """float32 layers in the float kernel and attention in the decode kernel: every row is computed on
    its own, so no row count needs padding (a step of 57 rows runs 57, not 64)."""
    from transformers import AutoModelForCausalLM

    from runtime.model.row_padding import RowPadding

    torch_layers = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert RowPadding.probe(torch_layers, max_rows=300, block_size=4).pad(57) == 64  # probed buckets
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    float_layers(model)
    padding = RowPadding.probe(model, max_rows=300, block_size=4)
    assert [padding.pad(rows) for rows in (1, 57, 129, 300)] == [1, 57, 129, 300]


def test_layers_the_kernel_cannot_take_keep_torch_s_and_the_line_says_how_many():
    model = nn.Sequential(nn.Linear(32, 40), nn.Linear(40, 16), nn.Linear(16, 8).half())
    quantized = float_layers(model)
    assert (quantized.mode, quantized.layers) == ("float", 2)
    assert quantized.detail == ("2 layers in ponder's float kernel (1 float16, 1 float32), 1 in torch's matmul "
                                "(in_features not a multiple of 16)")
    assert [type(m).__name__ for m in model] == ["FloatLinear", "Linear", "FloatLinear"]
    assert model[2].weight.dtype == torch.float16
    assert float_layers(nn.Sequential(nn.Linear(8, 8))).detail == \
        "not a GGUF model; no layer ponder's float kernel takes"


def test_a_reward_model_on_a_cpu_runs_its_float_layers_in_the_kernel(tiny_llama, tmp_path):
    from runtime.bootstrap import build_engine
    from runtime.wire.options import RuntimeOptions
    from tests.conftest import build_model

    prm = build_model(tmp_path / "prm", "qwen2", seed=2, layers=3)
    engine, _ = build_engine(RuntimeOptions(model=str(tiny_llama), device="cpu", block_size=4,
                                            kv_memory_bytes=4 << 20, verifier_kv_memory_bytes=2 << 20,
                                            verifiers={"prm": {"kind": "math-shepherd", "path": str(prm)}}))
    model = engine.scorers["prm"].verifier.model
    assert any(isinstance(m, FloatLinear) for m in model.modules())
    assert not any(type(m) is nn.Linear for m in model.modules())
