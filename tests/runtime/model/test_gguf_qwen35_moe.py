"""Qwen3.5-MoE GGUF files (llama.cpp's `qwen35moe`, as its converter writes them: tests/gguf_qwen35.py):
the config from the file's metadata, the stacked experts (`ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`) one kernel layer an expert in the file's blocks, the router in ponder's float kernel
renormalising its top-k as transformers' Qwen3.5-MoE router does, the shared expert and its gate, and
transformers' tokens served."""

from __future__ import annotations

import subprocess

import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from transformers import AutoModelForCausalLM

from runtime.kernels.cpu_kernels import q4_unavailable
from runtime.model.cached_model import gguf_config
from runtime.model.experts import KernelExperts, KernelRouter
from runtime.model.float_layers import FloatLinear
from runtime.model.gguf_config import config_from_gguf
from runtime.model.gguf_load import load_gguf_blocks
from runtime.model.loader import resolve_model
from runtime.model.quantize import Int4Linear
from tests.gguf_qwen35 import write_qwen35_gguf
from tests.llama_cpp import LLAMA_CPP, convert_with_llama_cpp
from tests.replicas.hybrid import write_qwen35
from tests.runtime.engine_helpers import engine_for, hf_greedy, request, run

pytestmark = pytest.mark.skipif(q4_unavailable() is not None, reason="kernel layers need ponder's CPU kernel")

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [1, 20, 21]]


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    directory = write_qwen35(tmp_path_factory.mktemp("qwen35moe"), moe=True)
    return directory, AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def greedy(engine, prompts=PROMPTS, max_tokens=10):
    results = run(engine, [request(str(i), p, max_tokens=max_tokens) for i, p in enumerate(prompts)])
    return [results[str(i)]["choices"][0] for i in range(len(prompts))]


def routed_blocks(model):
    return [layer.mlp for layer in model.model.layers]


def test_the_experts_config_is_read_from_the_file_s_own_metadata(replica, tmp_path):
    _, reference = replica
    path = write_qwen35_gguf(reference.config.to_dict(), reference.state_dict(), tmp_path / "q35moe.gguf")
    config, expected = config_from_gguf(str(path)), reference.config
    assert config.model_type == "qwen3_5_moe_text"
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "num_hidden_layers", "hidden_size", "layer_types", "linear_num_value_heads"):
        assert getattr(config, field) == getattr(expected, field), field


def test_an_f32_file_holds_every_expert_and_serves_transformers_tokens(replica, tmp_path):
    """Each expert's gate/up and down are the replica's stacked slabs, in ponder's float kernel; the
    router renormalises its top 2 (transformers' Qwen3.5-MoE router always does); the shared expert and
    its gate are the replica's; greedy tokens are transformers' `generate` on the replica directory."""
    _, reference = replica
    path = write_qwen35_gguf(reference.config.to_dict(), reference.state_dict(), tmp_path / "q35moe-f32.gguf")
    engine = engine_for(path)
    model = engine.runner.model
    expected = reference.state_dict()
    for i, block in enumerate(routed_blocks(model)):
        prefix = f"model.layers.{i}.mlp"
        assert isinstance(block.experts, KernelExperts) and isinstance(block.gate, KernelRouter)
        assert (block.gate.routing.top_k, block.gate.routing.norm_topk_prob) == (2, True)
        assert torch.equal(block.gate.linear.dequantized(), expected[f"{prefix}.gate.weight"])
        for e, (gate_up, down) in enumerate(zip(block.experts.gate_up, block.experts.down)):
            assert isinstance(gate_up, FloatLinear) and isinstance(down, FloatLinear)
            assert torch.equal(gate_up.dequantized(), expected[f"{prefix}.experts.gate_up_proj"][e])
            assert torch.equal(down.dequantized(), expected[f"{prefix}.experts.down_proj"][e])
        shared_gate = block.shared_expert_gate
        weight = shared_gate.dequantized() if hasattr(shared_gate, "dequantized") else shared_gate.weight
        assert torch.equal(weight, expected[f"{prefix}.shared_expert_gate.weight"])
        for part in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(getattr(block.shared_expert, part).dequantized(),
                               expected[f"{prefix}.shared_expert.{part}.weight"]), part
    assert greedy(engine) == [hf_greedy(reference, p, 10) for p in PROMPTS]


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_a_quantized_file_keeps_its_experts_blocks_and_serves_generate_s_tokens(replica, tmp_path, kind):
    """Every expert is one int layer over its slab of the stacked tensor's blocks, gguf's dequantized
    slab exactly; the tokens are transformers' `generate` over the same layers; a prompt's tokens do
    not depend on the other prompt beside it."""
    _, reference = replica
    config = reference.config.to_dict()
    path = write_qwen35_gguf(config, reference.state_dict(), tmp_path / f"q35moe-{kind}.gguf", kind, embedding="Q8_0")
    engine = engine_for(path)
    assert engine.quantized.mode == "int4"
    stored = {t.name: t for t in GGUFReader(str(path)).tensors}
    inner = config["moe_intermediate_size"]
    for i, block in enumerate(routed_blocks(engine.runner.model)):
        gate, up, down = (torch.from_numpy(dequantize(stored[f"blk.{i}.ffn_{p}_exps.weight"].data,
                                                      stored[f"blk.{i}.ffn_{p}_exps.weight"].tensor_type))
                          for p in ("gate", "up", "down"))
        assert stored[f"blk.{i}.ffn_gate_exps.weight"].tensor_type.name == kind
        for e, (gate_up, down_layer) in enumerate(zip(block.experts.gate_up, block.experts.down)):
            assert isinstance(gate_up, Int4Linear) and isinstance(down_layer, Int4Linear)
            assert torch.equal(gate_up.dequantized()[:inner], gate[e]) and torch.equal(gate_up.dequantized()[inner:], up[e])
            assert torch.equal(down_layer.dequantized(), down[e])
    source = resolve_model(str(path))
    same_layers, _ = load_gguf_blocks(source, gguf_config(source), torch.float32, "sdpa")
    together = greedy(engine)
    assert together == [hf_greedy(same_layers, p, 10) for p in PROMPTS]
    assert [greedy(engine, [p])[0] for p in PROMPTS] == together


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").exists(), reason=f"llama.cpp's converter is not at {LLAMA_CPP}")
def test_a_file_from_llama_cpp_s_converter_serves_transformers_tokens(replica, tmp_path):
    """The replica directory through llama.cpp's own converter (F32, no MTP) and, where its
    llama-quantize is built, Q8_0 from that file."""
    directory, reference = replica
    path = convert_with_llama_cpp(directory, tmp_path / "q35moe-real-f32.gguf", "qwen35", "--no-mtp")
    engine = engine_for(path)
    assert all(isinstance(block.experts, KernelExperts) for block in routed_blocks(engine.runner.model))
    assert greedy(engine) == [hf_greedy(reference, p, 10) for p in PROMPTS]
    quantize = LLAMA_CPP / "build" / "bin" / "llama-quantize"
    if not quantize.exists():
        return
    quantized = tmp_path / "q35moe-real-Q8_0.gguf"
    subprocess.run([str(quantize), str(path), str(quantized), "Q8_0"], check=True, capture_output=True)
    engine = engine_for(quantized)
    assert engine.quantized.mode == "int4"
    source = resolve_model(str(quantized))
    same_layers, _ = load_gguf_blocks(source, gguf_config(source), torch.float32, "sdpa")
    assert greedy(engine) == [hf_greedy(same_layers, p, 10) for p in PROMPTS]
