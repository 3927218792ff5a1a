"""gpt-oss GGUF files (tests/gguf_gpt_oss.py: the gpt-oss replica's weights as llama.cpp's converter
writes them, the experts MXFP4 as llama-quantize's MXFP4_MOE types them) read from the file: the config
from its own metadata, each expert's layers kept in the file's blocks (runtime.model.gguf_gpt_oss), served
by the lean decoder with transformers' tokens."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from transformers import AutoConfig, AutoModelForCausalLM

from runtime.kernels.cpu_kernels import q4_unavailable
from runtime.model.cached_model import gguf_config
from runtime.model.experts import KernelExperts, KernelRouter
from runtime.model.float_layers import FloatLinear
from runtime.model.gguf_config import Metadata, config_fields, config_from_gguf
from runtime.model.gguf_experts import HalvesClampedSwiGLU
from runtime.model.gguf_load import load_gguf_blocks
from runtime.model.loader import resolve_model
from runtime.model.quantize import Int4Linear
from tests.gguf_gpt_oss import dequantized_replica, write_gpt_oss_gguf
from tests.llama_cpp import LLAMA_CPP, convert_with_llama_cpp
from tests.replicas.families import NUM_EXPERTS, SLIDING_WINDOW, write_family
from tests.runtime.engine_helpers import engine_for, hf_greedy, request, run
from tests.runtime.model.test_decoder import LONG_PROMPT, PROMPTS

pytestmark = pytest.mark.skipif(q4_unavailable() is not None, reason="kernel layers need ponder's CPU kernel")

ALL_PROMPTS = [*PROMPTS, LONG_PROMPT]  # (the long one past the sliding window)
CONFIG_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window", "layer_types",
                 "rope_parameters", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                 "attention_bias", "swiglu_limit", "swiglu_alpha")


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    return write_family("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))


@pytest.fixture(scope="module")
def mxfp4_file(replica, tmp_path_factory):
    """As MXFP4_MOE makes them: experts MXFP4, the other linear tensors, the embedding and the head Q8_0."""
    return write_gpt_oss_gguf(replica, tmp_path_factory.mktemp("gpt_oss_mxfp4") / "gpt-oss-MXFP4_MOE.gguf")


def greedy(engine, prompts=ALL_PROMPTS, max_tokens=10):
    results = run(engine, [request(str(i), p, max_tokens=max_tokens) for i, p in enumerate(prompts)])
    return [results[str(i)]["choices"][0] for i in range(len(prompts))]


def reference_model(directory) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, experts_implementation="eager").eval()


def test_the_config_is_the_replica_s_read_from_the_file_s_own_metadata(replica, mxfp4_file):
    config, expected = config_from_gguf(str(mxfp4_file)), AutoConfig.from_pretrained(replica)
    assert config.model_type == "gpt_oss" and config.sliding_window == SLIDING_WINDOW
    assert {name: getattr(config, name) for name in CONFIG_FIELDS} == \
        {name: getattr(expected, name) for name in CONFIG_FIELDS}
    assert config.rms_norm_eps == float(np.float32(expected.rms_norm_eps))  # (the file's float32, as llama.cpp's)


def test_the_sliding_layers_follow_the_file_s_pattern():
    """llama.cpp's `attention.sliding_window_pattern`: a flag a layer, or a period n (layer i slides where
    i % n < n - 1); absent, every other layer from the first."""
    meta = Metadata.__new__(Metadata)
    meta.architecture, meta.num_tokens = "gpt-oss", 96
    meta.shapes = {"token_embd.weight": (96, 64), "output.weight": (96, 64)}
    meta.values = {"gpt-oss.block_count": 4, "gpt-oss.embedding_length": 64, "gpt-oss.attention.head_count": 4,
                   "gpt-oss.rope.freq_base": 150000.0}

    def layer_types(pattern):
        if pattern is not None:
            meta.values["gpt-oss.attention.sliding_window_pattern"] = pattern
        fields = config_fields(meta)
        assert fields["rope_parameters"] == {"rope_type": "default", "rope_theta": 150000.0}  # no rope.scaling
        return [t[0] for t in fields["layer_types"]]  # s(liding) or f(ull)

    assert layer_types(None) == ["s", "f", "s", "f"]
    assert layer_types(3) == ["s", "s", "f", "s"]
    assert layer_types([False, True, True, False]) == ["f", "s", "s", "f"]


def test_an_f32_file_serves_transformers_tokens_on_the_same_weights(replica, tmp_path):
    path = write_gpt_oss_gguf(replica, tmp_path / "gpt-oss-f32.gguf", experts="F32", linear="F32")
    engine = engine_for(path, batch_invariant=True, num_blocks=64)
    mlp = engine.runner.model.model.layers[0].mlp
    assert isinstance(mlp.experts, KernelExperts) and isinstance(mlp.router, KernelRouter)
    assert isinstance(mlp.experts.glu, HalvesClampedSwiGLU) and mlp.router.routing.softmax_first is False
    assert all(isinstance(layer, FloatLinear) and layer.weight.dtype == torch.float32 and layer.bias is not None
               for layer in [*mlp.experts.gate_up, *mlp.experts.down])
    decoder = engine.runner.decoder
    assert all(layer.moe is not None and layer.sinks is not None for layer in decoder.layers)
    assert [layer.window for layer in decoder.layers] == [SLIDING_WINDOW, None]
    assert engine.quantized.describe() == (
        "model.quantize = auto: float (15 layers run in ponder's float kernel in the file's own type (15 F32); "
        "linear tensors in the file: 15 F32)")
    reference = reference_model(replica)
    assert greedy(engine) == [hf_greedy(reference, p, 10) for p in ALL_PROMPTS]


def test_the_mxfp4_experts_keep_the_file_s_blocks_and_serve_generate_s_tokens(mxfp4_file):
    """Each expert's layers hold its slab of the file's blocks (8-bit codes, a float32 power of two a
    group: the weights gguf dequantizes them to, gate rows then up rows) and biases; the lean decoder gives
    the tokens transformers' `generate` gives over the same kernel layers, and a row alone the tokens it
    gets in a crowd."""
    engine = engine_for(mxfp4_file, batch_invariant=True, num_blocks=64)
    model = engine.runner.model
    tensors = {t.name: t for t in GGUFReader(str(mxfp4_file)).tensors}

    def values(name):
        return torch.from_numpy(np.array(dequantize(tensors[name].data, tensors[name].tensor_type)))

    for i, layer in enumerate(model.model.layers):
        experts, b = layer.mlp.experts, f"blk.{i}."
        assert len(experts.down) == NUM_EXPERTS
        for e in range(NUM_EXPERTS):
            gate_up, down = experts.gate_up[e], experts.down[e]
            assert isinstance(gate_up, Int4Linear) and gate_up.bits == 8 and gate_up.d.dtype == torch.float32
            assert gate_up.m is None and isinstance(down, Int4Linear) and down.bits == 8
            assert torch.equal(gate_up.dequantized(), torch.cat([values(b + "ffn_gate_exps.weight")[e],
                                                                 values(b + "ffn_up_exps.weight")[e]]))
            assert torch.equal(down.dequantized(), values(b + "ffn_down_exps.weight")[e])
            assert torch.equal(gate_up.bias, torch.cat([values(b + "ffn_gate_exps.bias")[e],
                                                        values(b + "ffn_up_exps.bias")[e]]))
            assert torch.equal(down.bias, values(b + "ffn_down_exps.bias")[e])
    assert engine.quantized.describe() == (
        "model.quantize = auto: int4 (15 layers keep the GGUF's blocks (6 MXFP4, 9 Q8_0); linear tensors in the "
        "file: 6 MXFP4, 9 Q8_0)")
    assert engine.quantized.block_types == ("MXFP4", "Q8_0")
    source = resolve_model(str(mxfp4_file))
    reference, _ = load_gguf_blocks(source, gguf_config(source), torch.float32, "eager")
    served = greedy(engine)
    assert served == [hf_greedy(reference, p, 10) for p in ALL_PROMPTS]
    for i, prompt in enumerate(ALL_PROMPTS):
        assert greedy(engine, [prompt]) == [served[i]]


def test_mxfp4_experts_give_transformers_float_model_s_tokens_on_the_weights_they_stand_for(replica, tmp_path):
    """The file's MXFP4 experts (every other tensor F32) against transformers' float gpt-oss on the weights
    gguf dequantizes them to: the int kernel rounds the experts' inputs to int8 per group of 32, so the
    logits are close (within 3 % of the largest), not the same bits, and the greedy tokens the same."""
    path = write_gpt_oss_gguf(replica, tmp_path / "gpt-oss-mxfp4-f32.gguf", experts="MXFP4", linear="F32")
    reference = reference_model(dequantized_replica(replica, path, tmp_path / "dequantized"))
    engine = engine_for(path, batch_invariant=True, num_blocks=64)
    assert engine.quantized.block_types == ("F32", "MXFP4")
    source = resolve_model(str(path))
    loaded, _ = load_gguf_blocks(source, gguf_config(source), torch.float32, "eager")  # the engine's layers
    ids = torch.tensor([LONG_PROMPT])
    with torch.no_grad():
        served, expected = loaded(ids).logits, reference(ids).logits
    # (each kernel call rounds its input to int8 per group of 32: about 0.5 % of a layer's output, as for
    # every block type, tests/runtime/kernels/test_block_kernels.py; 1.8 % here after two layers)
    assert (served - expected).abs().max() <= 0.03 * expected.abs().max()
    assert greedy(engine) == [hf_greedy(reference, p, 10) for p in ALL_PROMPTS]


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").exists(), reason=f"llama.cpp's converter is not at {LLAMA_CPP}")
def test_a_file_from_llama_cpp_s_converter_serves_transformers_tokens(replica, tmp_path):
    """The replica directory through llama.cpp's own convert_hf_to_gguf.py (F32) and, where its
    llama-quantize is built, MXFP4_MOE (MXFP4 experts, Q8_0 elsewhere) from that file."""
    path = convert_with_llama_cpp(replica, tmp_path / "gpt-oss-real-f32.gguf", "llama-bpe")
    assert greedy(engine_for(path, num_blocks=64)) == [hf_greedy(reference_model(replica), p, 10) for p in ALL_PROMPTS]
    quantize = LLAMA_CPP / "build" / "bin" / "llama-quantize"
    if not quantize.exists():
        return
    quantized = tmp_path / "gpt-oss-real-MXFP4_MOE.gguf"
    subprocess.run([str(quantize), str(path), str(quantized), "MXFP4_MOE"], check=True, capture_output=True)
    engine = engine_for(quantized, num_blocks=64)
    assert engine.quantized.block_types == ("MXFP4", "Q8_0")
    source = resolve_model(str(quantized))
    same_layers, _ = load_gguf_blocks(source, gguf_config(source), torch.float32, "eager")
    assert greedy(engine) == [hf_greedy(same_layers, p, 10) for p in ALL_PROMPTS]
