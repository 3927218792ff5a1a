"""Qwen3.5 GGUF files (llama.cpp's `qwen35`, as its converter writes them: tests/gguf_qwen35.py) read from
their own metadata and tensors, the converter's transforms inverted (runtime.model.gguf_qwen35), every
linear tensor kept in the file's blocks (or its floats in the float kernel), the embedding in its blocks."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH, GGUFReader, get_tensor_name_map
from gguf.quants import dequantize
from torch import nn
from transformers import AutoModelForCausalLM

from runtime.bootstrap import engine_paths
from runtime.kernels.cpu_kernels import q4_unavailable
from runtime.model.block_embedding import HeadRowsEmbedding
from runtime.model.cached_model import gguf_config
from runtime.model.float_layers import FloatLinear
from runtime.model.gguf_config import config_from_gguf
from runtime.model.gguf_load import load_gguf_blocks
from runtime.model.gguf_qwen35 import InputOrder
from runtime.model.loader import resolve_model
from runtime.model.quantize import Int4Linear
from tests.gguf_qwen35 import replica_tensors, to_file, wide_text_config, write_qwen35_gguf
from tests.llama_cpp import LLAMA_CPP, convert_with_llama_cpp
from tests.replicas.hybrid import write_qwen35
from tests.runtime.engine_helpers import engine_for, hf_greedy, request, run

pytestmark = pytest.mark.skipif(q4_unavailable() is not None, reason="kernel layers need ponder's CPU kernel")

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [1, 20, 21]]


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    directory = write_qwen35(tmp_path_factory.mktemp("qwen35"))
    return directory, AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def greedy(engine, prompts=PROMPTS, max_tokens=10):
    results = run(engine, [request(str(i), p, max_tokens=max_tokens) for i, p in enumerate(prompts)])
    return [results[str(i)]["choices"][0] for i in range(len(prompts))]


def served_layers(model: nn.Module):
    """(transformers' parameter name, the layer) of every linear layer ponder serves in its own kernels."""
    for name, module in model.named_modules():
        if isinstance(module, InputOrder) or (isinstance(module, (Int4Linear, FloatLinear))
                                              and not name.endswith(".layer")):
            yield f"{name}.weight", module


def test_the_config_is_read_from_the_file_s_own_metadata(replica, tmp_path):
    _, reference = replica
    path = write_qwen35_gguf(reference.config.to_dict(), reference.state_dict(), tmp_path / "q35.gguf")
    config, expected = config_from_gguf(str(path)), reference.config
    assert config.model_type == "qwen3_5_text"
    for field in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "layer_types", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_num_key_heads", "linear_num_value_heads", "vocab_size", "tie_word_embeddings"):
        assert getattr(config, field) == getattr(expected, field), field
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert config.rope_parameters == expected.rope_parameters
    assert np.float32(config.rms_norm_eps) == np.float32(expected.rms_norm_eps)


def test_an_f32_file_holds_the_replica_s_tensors_and_serves_transformers_tokens(replica, tmp_path):
    """Every tensor read back gives what the replica's gives, bit for bit: the same tensor, or for the
    decay and the (1 + w) norms what transformers computes from them (the file holds those, rounded:
    `A_log` and `w` themselves are not recoverable), the value heads grouped back, `ssm_out` computed over its input in the file's
    order; greedy tokens are transformers' `generate` on the replica directory."""
    _, reference = replica
    path = write_qwen35_gguf(reference.config.to_dict(), reference.state_dict(), tmp_path / "q35-f32.gguf")
    engine = engine_for(path)
    model = engine.runner.model
    expected = reference.state_dict()
    layers = dict(served_layers(model))
    assert isinstance(model.model.layers[0].linear_attn.out_proj, InputOrder)  # 2 key heads, 4 value heads: tiled
    assert not any(type(m) is nn.Linear for m in model.modules())
    for name, value in expected.items():
        if name in layers:
            assert torch.equal(layers[name].dequantized(), value), name
        elif name.endswith("A_log"):
            assert torch.equal(model.get_parameter(name).exp(), value.exp()), name
        elif name.endswith("norm.weight") and ".linear_attn." not in name:  # transformers multiplies by 1 + weight
            assert torch.equal(1.0 + model.get_parameter(name), 1.0 + value), name
        elif name != "lm_head.weight":
            assert torch.equal(model.get_parameter(name), value), name
    assert engine_paths(engine) == {"family": "qwen3_5", "layers": "lean", "linear": "float_kernel",
                                    "attention": "cpu_kernel", "recurrent": "cpu_kernel"}
    assert greedy(engine) == [hf_greedy(reference, p, 10) for p in PROMPTS]


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_a_quantized_file_keeps_its_blocks_and_serves_generate_s_tokens(replica, tmp_path, kind):
    """Each linear layer holds the file's blocks, whose weights put back through the converter's
    transforms are gguf's dequantized tensor exactly; the embedding reads its rows from the tied head's
    blocks; the tokens are transformers' `generate` over the same layers. (Q4_K: a replica 256 wide, a
    K-quant's super-block.)"""
    _, reference = replica
    if kind == "Q4_K":
        config = wide_text_config()
        tensors = replica_tensors(config)
    else:
        config, tensors = reference.config.to_dict(), reference.state_dict()
    path = write_qwen35_gguf(config, tensors, tmp_path / f"q35-{kind}.gguf", kind, embedding="Q8_0")
    engine = engine_for(path)
    model = engine.runner.model
    assert engine.quantized.mode == "int4"
    assert isinstance(model.model.embed_tokens, HeadRowsEmbedding) and isinstance(model.lm_head, Int4Linear)
    assert not any(type(m) is nn.Linear for m in model.modules())
    names = get_tensor_name_map(MODEL_ARCH.QWEN35, config["num_hidden_layers"])
    stored = {t.name: t for t in GGUFReader(str(path)).tensors}
    checked = 0
    for name, layer in served_layers(model):
        renamed, value = to_file(name, layer.dequantized(), config)
        tensor = stored["token_embd.weight" if name == "lm_head.weight" else names.get_name(renamed, try_suffixes=(".weight",))]
        expected_kind = "Q8_0" if name == "lm_head.weight" else kind
        assert tensor.tensor_type.name == expected_kind
        assert isinstance(layer.layer if isinstance(layer, InputOrder) else layer, Int4Linear)
        assert torch.equal(value, torch.from_numpy(dequantize(tensor.data, tensor.tensor_type))), name
        checked += 1
    assert checked == 3 * (5 + 3) + (4 + 3) + 1  # 3 recurrent layers' 5 and MLP's 3, the attention's 4 and MLP's 3, the head
    source = resolve_model(str(path))
    same_layers, _ = load_gguf_blocks(source, gguf_config(source), torch.float32, "sdpa")
    assert greedy(engine) == [hf_greedy(same_layers, p, 10) for p in PROMPTS]


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").exists(), reason=f"llama.cpp's converter is not at {LLAMA_CPP}")
def test_a_file_from_llama_cpp_s_converter_serves_transformers_tokens(replica, tmp_path):
    """The replica directory through llama.cpp's own convert_hf_to_gguf.py (F32, no MTP) and, where its
    llama-quantize is built, Q8_0 and Q4_K_M (64-wide tensors: its fallbacks) from that file."""
    directory, reference = replica
    path = convert_with_llama_cpp(directory, tmp_path / "q35-real-f32.gguf", "qwen35", "--no-mtp")
    assert greedy(engine_for(path)) == [hf_greedy(reference, p, 10) for p in PROMPTS]
    quantize = LLAMA_CPP / "build" / "bin" / "llama-quantize"
    if not quantize.exists():
        return
    for kind in ("Q8_0", "Q4_K_M"):
        quantized = tmp_path / f"q35-real-{kind}.gguf"
        subprocess.run([str(quantize), str(path), str(quantized), kind], check=True, capture_output=True)
        engine = engine_for(quantized)
        assert engine.quantized.mode == "int4"
        source = resolve_model(str(quantized))
        same_layers, _ = load_gguf_blocks(source, gguf_config(source), torch.float32, "sdpa")
        assert greedy(engine) == [hf_greedy(same_layers, p, 10) for p in PROMPTS]
