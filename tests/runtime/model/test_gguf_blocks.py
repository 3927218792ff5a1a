import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from torch import nn
from transformers import AutoModelForCausalLM

from runtime.kernels.cpu_kernels import KernelUnavailable
from runtime.model.gguf_blocks import decode, linear_blocks
from runtime.model.quantize import Int4Linear, QuantizeError, apply_quantize, linear_layers
from tests.gguf_model import write_tiny_gguf
from tests.runtime.engine_helpers import engine_for, hf_greedy, request, run

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 20, 21], [1, 40]]


@pytest.fixture(scope="module", params=["Q4_1", "Q4_0"])
def tiny_gguf(request, tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp(f"gguf-{request.param}"), request.param)


def load(path):
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_blocks_decode_to_what_gguf_dequantizes_bit_for_bit(kind):
    weights = (np.random.default_rng(0).standard_normal((48, 96)) * 0.3).astype(np.float32)
    data = quantize(weights, GGMLQuantizationType[kind])
    blocks = decode(kind, data)
    assert blocks.codes.shape == (48, 96) and int(blocks.codes.max()) <= 15
    assert torch.equal(blocks.dequantized(), torch.from_numpy(dequantize(data, GGMLQuantizationType[kind])))


def test_mxfp4_blocks_of_every_scale_are_their_codes_times_a_power_of_two_bit_for_bit():
    # Every E8M0 byte whose weights stay finite in float32 (0 and 1 give subnormal scales; from 253 on,
    # 12 times the scale overflows), every code: an int8 code and a float32 d = 2^(e - 128) a group, no m.
    data = np.random.default_rng(0).integers(0, 256, (253, 4, 17), dtype=np.uint8)
    data[..., 0] = np.arange(253, dtype=np.uint8)[:, None]
    data = data.reshape(253, -1)
    blocks = decode("MXFP4", data)
    assert blocks.codes.dtype == torch.int8 and blocks.d.dtype == torch.float32 and blocks.m is None
    assert blocks.float_scales and blocks.bits == 8
    assert sorted(blocks.codes.unique().tolist()) == [-12, -8, -6, -4, -3, -2, -1, 0, 1, 2, 3, 4, 6, 8, 12]
    powers = torch.from_numpy(np.ldexp(1.0, np.arange(253) - 128)).float()
    assert torch.equal(blocks.d, powers[:, None].expand(253, 4)) and bool((blocks.d[:2] > 0).all())
    assert torch.equal(blocks.dequantized(), torch.from_numpy(dequantize(data, GGMLQuantizationType.MXFP4)))


def test_every_layer_is_matched_to_the_weights_transformers_loaded(tiny_gguf):
    model = load(tiny_gguf)
    blocks, found = linear_blocks(model, str(tiny_gguf))
    names = [name for name, *_ in linear_layers(model)]
    assert sorted(blocks) == sorted(names)  # the head is the Q8_0 embedding, whose blocks it keeps
    assert blocks["lm_head"].kind == "Q8_0"
    kind = tiny_gguf.parent.name.split("-")[1][:4]
    assert found == f"linear tensors in the file: 14 {kind}, 1 Q8_0"
    modules = dict(model.named_modules())
    for name, b in blocks.items():  # q/k rows included, which transformers reorders on load
        assert torch.equal(b.dequantized(), modules[name].weight.detach())


def test_auto_keeps_the_file_s_blocks_exactly(tiny_gguf):
    model = load(tiny_gguf)
    reference = {name: layer.weight.detach().clone() for name, _, _, layer in linear_layers(model)}
    blocks, _ = linear_blocks(model, str(tiny_gguf))
    quantized = apply_quantize(model, "auto", str(tiny_gguf))
    assert (quantized.mode, quantized.layers) == ("int4", 15)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    modules = dict(model.named_modules())
    for name, b in blocks.items():
        layer = modules[name]
        assert isinstance(layer, Int4Linear)
        d, m = layer.group_scales()
        assert torch.equal(d, b.d) and (m is None if b.m is None else torch.equal(m, b.m))  # float16 holds them exactly
        assert torch.equal(layer.dequantized(), reference[name])  # the very weights the file stores


def test_the_default_engine_serves_the_gguf_s_int4_and_matches_generate_on_it(tiny_gguf):
    engine = engine_for(tiny_gguf, batch_invariant=False)  # quantize left at its default, auto
    assert engine.quantized.mode == "int4"
    reference = load(tiny_gguf)
    apply_quantize(reference, "auto", str(tiny_gguf))
    results = run(engine, [request(str(i), p, max_tokens=10) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        assert results[str(i)]["choices"][0] == hf_greedy(reference, prompt, 10)


def test_auto_keeps_float_weights_for_a_safetensors_model(tiny_llama):
    """The float weights stay as they are, run by ponder's float kernel (tests/runtime/model/test_float_linear.py);
    `none` keeps torch's layers."""
    engine = engine_for(tiny_llama)
    assert engine.quantized.mode == "float"
    assert engine.quantized.detail == "15 layers in ponder's float kernel (15 float32)"
    assert not any(type(m) is nn.Linear for m in engine.model.modules())
    engine = engine_for(tiny_llama, quantize="none")
    assert (engine.quantized.mode, engine.quantized.detail) == ("none", "float weights")
    assert any(type(m) is nn.Linear for m in engine.model.modules())


def test_auto_keeps_float_weights_off_the_cpu(tiny_gguf):
    model = load(tiny_gguf).to("meta")
    quantized = apply_quantize(model, "auto", str(tiny_gguf))
    assert (quantized.mode, quantized.detail) == ("none", "the quantized kernels are the CPU's, and the model is on meta")


def test_blocks_that_do_not_give_the_loaded_weights_stop_start_up(tiny_gguf):
    model = load(tiny_gguf)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] += 1
    with pytest.raises(QuantizeError, match=r"^model\.quantize = 'auto' cannot keep the GGUF's blocks: the Q4_[01] "
                                            r"blocks of blk\.1\.ffn_up\.weight do not give the weights loaded into "
                                            r"model\.layers\.1\.mlp\.up_proj; set model\.quantize = \"none\"$"):
        apply_quantize(model, "auto", str(tiny_gguf))


def test_auto_keeps_float_weights_where_the_int4_kernel_cannot_run(tiny_gguf, monkeypatch):
    def unavailable():
        raise KernelUnavailable("ponder's int4 CPU kernel cannot run here: it needs AVX2")

    monkeypatch.setattr("runtime.model.quantize.q4_kernel", unavailable)
    quantized = apply_quantize(load(tiny_gguf), "auto", str(tiny_gguf))
    assert (quantized.mode, quantized.layers) == ("none", 0)
    assert quantized.detail == "ponder's int4 CPU kernel cannot run here: it needs AVX2"
