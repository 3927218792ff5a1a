"""A GGUF loaded for a GPU with `quantize = "auto"` (runtime.model.gguf_load with a device): every linear
layer of a type the blocks cover holds the file's codes and scales in a `GpuBlockLinear`, computed by the
Triton block GEMM (here on the CPU in Triton's interpreter), and gives the tokens of the same file
dequantized."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from runtime.model.cached_model import gguf_config, load_quantized_model
from runtime.model.gguf_load import load_gguf_blocks
from runtime.model.gpu_blocks import GpuBlockLinear, SideBySide
from runtime.model.loader import load_causal_lm, resolve_model
from runtime.model.gguf_blocks import SUPPORTED
from tests.gguf_model import blocks_of, write_tiny_gguf
from tests.runtime.engine_helpers import engine_for, hf_greedy, request, run

# Every form the layers take: codes two a byte (Q4_0, Q4_1) or one (Q5_0, Q5_1, Q8_0), with m or
# without (Q8_0); the qkv projections of three forms, fused side by side.
MIXED = {"attn_q": "Q4_0", "attn_k": "Q5_1", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_down": "Q8_0"}
# As llama-quantize's Q4_K_M mixes them, on 256-wide rows (K-quants' super-blocks).
K_MIXED = {"attn_v": "Q6_K", "ffn_down": "Q6_K"}
PACKED = ("Q4_0", "Q4_1", "Q4_K", "Q2_K", "Q3_K")  # codes in 0..15 (Q3_K's -4..3 plus 4)
SIX_BITS = ("Q5_0", "Q5_1", "Q5_K", "Q6_K")  # codes in 0..63 (Q6_K's -32..31 plus 32): a nibble and two bits
PER_16 = ("Q2_K", "Q3_K", "Q6_K")  # a scale per 16 inputs, else per 32
NO_M = ("Q8_0", "Q6_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4")
SUPER_BLOCKS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # scales a group times a super-block's
PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
CPU = torch.device("cpu")


def expected_bytes(kind: str, out_features: int, in_features: int) -> int:
    """Codes (half a byte, three quarters or a byte each) and float32 d (and m) per group; the K-quants'
    and IQ4_XS's as the file holds them, an int8 sub-scale a group and a float32 super-block scale a 256
    inputs."""
    weights = out_features * in_features
    codes = weights // 2 if kind in PACKED else weights * 3 // 4 if kind in SIX_BITS else weights
    groups = out_features * in_features // (16 if kind in PER_16 else 32)
    scales = 1 if kind in NO_M else 2
    if kind in SUPER_BLOCKS:
        return codes + scales * (groups + 4 * out_features * in_features // 256)
    return codes + 4 * groups * scales


def load_both(tmp_path, kind, kinds, hidden):
    path = write_tiny_gguf(tmp_path, kind, kinds=kinds, hidden=hidden, ffn=2 * hidden)
    source = resolve_model(str(path))
    reference = load_causal_lm(source, CPU, torch.float32, "sdpa")  # transformers dequantizes every tensor
    model, quantized = load_gguf_blocks(source, gguf_config(source), torch.float32, "sdpa", device=CPU)
    return reference, model, quantized


@pytest.mark.parametrize("kind,kinds,hidden", [("Q4_1", MIXED, 64), ("Q4_K", K_MIXED, 256)])
def test_a_gguf_for_a_gpu_keeps_the_file_s_blocks_and_gives_its_dequantized_tokens(tmp_path, kind, kinds, hidden):
    reference, model, quantized = load_both(tmp_path, kind, kinds, hidden)
    assert quantized.mode == "gpu_blocks" and quantized.layers == 15
    kinds_of = {name: kinds.get(tensor, kind) for tensor, name in PROJECTIONS.items()}
    held = 0
    for i, layer in enumerate(model.model.layers):
        for name, layer_kind in kinds_of.items():
            module = layer.get_submodule(name)
            assert isinstance(module, GpuBlockLinear) and module.packed == (layer_kind in PACKED + SIX_BITS), (i, name)
            assert module.nbytes == expected_bytes(layer_kind, module.out_features, module.in_features), (i, name)
            held += module.nbytes
            # the file's weights exactly: what transformers' dequantized load holds, bit for bit
            assert torch.equal(module.dequantized(), reference.get_submodule(f"model.layers.{i}.{name}").weight)
    # the head tied to the Q8_0 embedding: a block layer of the embedding's blocks; the embedding floats
    head = model.lm_head
    assert isinstance(head, GpuBlockLinear) and torch.equal(head.dequantized(), reference.lm_head.weight)
    held += head.nbytes
    assert held == sum(m.nbytes for m in model.modules() if isinstance(m, GpuBlockLinear)) == \
        sum(expected_bytes(k, *reference.get_submodule(f"model.layers.{i}.{n}").weight.shape)
                     for i in range(2) for n, k in kinds_of.items()) + expected_bytes("Q8_0", 96, hidden)
    assert type(model.model.embed_tokens) is nn.Embedding
    assert torch.equal(model.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    assert quantized.block_types == tuple(sorted({*kinds_of.values(), "Q8_0"}))
    prompt = [1, 5, 6, 7, 8]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)  # float32 sums in another order
    if hidden == 64:  # (the 256-wide model's steps are slow in the interpreter: its logits above only)
        assert hf_greedy(model, prompt, 4) == hf_greedy(reference, prompt, 4)


def test_the_lean_decoder_s_triton_loop_runs_the_blocks_and_paths_say_so(tmp_path, monkeypatch):
    """Served end to end: the start-up path keeps the blocks (the flag a GPU sets, set here on the CPU),
    the lean decoder fuses them (q, k and v of three forms side by side; gate and up into one layer), its
    Triton loop runs the decode steps, and the tokens are those of the file dequantized."""
    from runtime.bootstrap import engine_paths

    path = write_tiny_gguf(tmp_path, "Q4_1", kinds=MIXED)
    requests = [request("a", [1, 5, 6, 7, 8], max_tokens=4), request("b", [1, 40], max_tokens=4)]
    expected = run(engine_for(path, quantize="none", num_blocks=32), requests)
    monkeypatch.setattr("runtime.bootstrap.load_quantized_model", functools.partial(load_quantized_model, gpu_blocks=True))
    engine = engine_for(path, num_blocks=32)  # quantize left at auto
    engine.runner.use_gpu_kernels()
    decoder = engine.runner.decoder
    assert decoder.gpu is not None
    layer = decoder.layers[0]
    assert isinstance(layer.qkv.fused, SideBySide) and isinstance(layer.gate_up.fused, GpuBlockLinear)
    assert engine_paths(engine)["linear"] == "triton_blocks" and engine_paths(engine)["layers"] == "triton"
    assert engine.quantized.describe() == (
        "model.quantize = auto: gpu_blocks (15 layers keep the GGUF's blocks (2 Q4_0, 4 Q4_1, 2 Q5_0, 2 Q5_1, 5 Q8_0); "
        "linear tensors in the file: 2 Q4_0, 4 Q4_1, 2 Q5_0, 2 Q5_1, 5 Q8_0)")
    assert run(engine, requests) == expected


@pytest.mark.parametrize("kind", SUPPORTED)
def test_every_block_type_on_the_device_is_gguf_s_dequantized_weights_in_its_bytes(kind):
    """The layer a slab at a time (3 rows a slab here) holds the file's weights bit for bit, in
    `expected_bytes`: codes two a byte where they are 0..15, else a byte each, float32 scales (the
    K-quants': int8 a group, float32 a super-block)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from runtime.model import gpu_blocks

    data = blocks_of(kind, 8, 256, seed=3)
    layer = gpu_blocks.gpu_block_layer(kind, lambda start, stop: data[start:stop], (8, 256), CPU, slab_rows=3)
    assert layer.packed == (kind in PACKED + SIX_BITS) and layer.nbytes == expected_bytes(kind, 8, 256)
    assert (layer.high is not None) == (kind in SIX_BITS)
    assert torch.equal(layer.dequantized(), torch.from_numpy(dequantize(data, GGMLQuantizationType[kind])))



def test_served_with_the_tensor_core_tile_for_every_layer_from_the_graphs_static_buffers(tmp_path, monkeypatch):
    """Every block layer on the tensor-core tile (16 rows a program), the decode steps from the static
    buffers a CUDA graph replays (run eagerly here): the probe accepts batch invariance, and the greedy
    tokens are the file's dequantized ones, a request's the same alone as beside another."""
    from runtime.kernels.gpu import linear

    path = write_tiny_gguf(tmp_path, "Q4_1", kinds=MIXED)
    requests = [request("a", [1, 5, 6, 7, 8], max_tokens=6), request("b", [1, 40], max_tokens=6)]
    expected = run(engine_for(path, quantize="none", num_blocks=32), requests)
    monkeypatch.setattr(linear, "TILE", (16, 32, 4, 1, 16))
    monkeypatch.setattr("runtime.bootstrap.load_quantized_model", functools.partial(load_quantized_model, gpu_blocks=True))
    engine = engine_for(path, num_blocks=32)
    engine.runner.use_gpu_kernels()
    assert engine.runner.use_graphs(capture=False, max_rows=4) and engine.runner.padding.max_rows
    assert run(engine, requests) == expected
    assert run(engine, requests[:1])["a"]["choices"] == expected["a"]["choices"]  # (its prompt cached now)


def test_a_block_model_s_down_projection_takes_the_gate_up_output_one_launch_fewer(tmp_path, monkeypatch):
    """A decode layer of block layers in the Triton loop: no SiLU * mul launch (the down projection's GEMM
    computes it as it loads), the file's dequantized tokens."""
    from runtime.kernels.gpu import linear
    from tests.runtime.gpu_path.test_gpu_layers import decode_launches

    path = write_tiny_gguf(tmp_path, "Q4_1")
    asked = [request("greedy", [1, 5, 6, 7, 8], max_tokens=3)]
    expected = run(engine_for(path, quantize="none", num_blocks=32), asked)
    monkeypatch.setattr("runtime.bootstrap.load_quantized_model", functools.partial(load_quantized_model, gpu_blocks=True))
    engine = engine_for(path, num_blocks=32)
    engine.runner.use_gpu_kernels()
    steps = decode_launches(engine, monkeypatch, asked, functions=((linear, "block_linear"),))
    layer = ["rms_norm", "block_linear", "attention_inputs", "decode_attention", "block_linear", "rms_norm",
             "block_linear", "block_linear"]
    assert steps[-1] == ["aten.zeros.default"] + layer * len(engine.runner.decoder.layers) + ["rms_norm"]
    engine = engine_for(path, num_blocks=32)
    engine.runner.use_gpu_kernels()
    assert run(engine, asked)["greedy"]["choices"] == expected["greedy"]["choices"]
