"""A Qwen3-MoE GGUF (tests/gguf_moe.py: the replica's weights as llama.cpp's converter lays them out)
loaded tensor by tensor, its stacked expert tensors into one kernel layer an expert
(runtime.model.gguf_experts), and served by the lean decoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from runtime.kernels.cpu_kernels import q4_unavailable
from runtime.model.experts import KernelExperts, KernelRouter
from runtime.model.cached_model import gguf_config
from runtime.model.float_layers import FloatLinear
from runtime.model.gguf_load import load_gguf_blocks
from runtime.model.loader import resolve_model
from runtime.model.quantize import Int4Linear
from tests.gguf_moe import replica_model, write_qwen3_moe_gguf
from tests.replicas.families import MOE_INTERMEDIATE, NUM_EXPERTS, write_family
from tests.runtime.engine_helpers import engine_for, hf_greedy, request, run

pytestmark = pytest.mark.skipif(q4_unavailable() is not None, reason="kernel layers need ponder's CPU kernel")

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 20, 21], [1, 40]]


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    return write_family("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


def greedy(engine, prompts=PROMPTS):
    results = run(engine, [request(str(i), p, max_tokens=10) for i, p in enumerate(prompts)])
    return [results[str(i)]["choices"][0] for i in range(len(prompts))]


def test_an_f32_file_serves_transformers_tokens_on_the_same_weights(replica, tmp_path):
    path = write_qwen3_moe_gguf(replica, tmp_path / "moe-f32.gguf", "F32")
    engine = engine_for(path, batch_invariant=True)
    model = engine.runner.model
    assert model.config.moe_intermediate_size == MOE_INTERMEDIATE  # the file's expert_feed_forward_length
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.experts, KernelExperts) and isinstance(mlp.gate, KernelRouter)
    assert all(isinstance(layer, FloatLinear) and layer.weight.dtype == torch.float32
               for layer in [*mlp.experts.gate_up, *mlp.experts.down])
    assert engine.runner.decoder.layers[0].moe.all_kernel(FloatLinear)
    assert engine.runner.decoder.stack is not None  # its decode steps one call of the stack kernel
    assert engine.quantized.describe() == (
        "model.quantize = auto: float (15 layers run in ponder's float kernel in the file's own type (15 F32); "
        "linear tensors in the file: 15 F32)")
    reference = replica_model(replica)
    assert greedy(engine) == [hf_greedy(reference, p, 10) for p in PROMPTS]


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_quantized_file_keeps_each_expert_s_blocks_and_serves_generate_s_tokens(replica, tmp_path, kind):
    """Each expert's layer holds its slab of the file's blocks (the weights gguf dequantizes them to);
    the lean decoder gives the tokens transformers' `generate` gives over the same kernel layers, and a
    row alone the tokens it gets in a crowd."""
    path = write_qwen3_moe_gguf(replica, tmp_path / f"moe-{kind}.gguf", kind)
    engine = engine_for(path, batch_invariant=True)
    decoder, model = engine.runner.decoder, engine.runner.model
    assert decoder.int4 and all(layer.moe.all_kernel(Int4Linear) for layer in decoder.layers)
    assert decoder.stack is not None  # its steps one call of the stack kernel (batch invariance: prompts too)
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        down = dequantize(tensors[f"blk.{i}.ffn_down_exps.weight"].data, tensors[f"blk.{i}.ffn_down_exps.weight"].tensor_type)
        gate = dequantize(tensors[f"blk.{i}.ffn_gate_exps.weight"].data, tensors[f"blk.{i}.ffn_gate_exps.weight"].tensor_type)
        up = dequantize(tensors[f"blk.{i}.ffn_up_exps.weight"].data, tensors[f"blk.{i}.ffn_up_exps.weight"].tensor_type)
        assert len(experts.down) == NUM_EXPERTS
        for e in range(NUM_EXPERTS):
            assert torch.equal(experts.down[e].dequantized(), torch.from_numpy(np.ascontiguousarray(down[e])))
            assert torch.equal(experts.gate_up[e].dequantized(), torch.from_numpy(np.concatenate([gate[e], up[e]])))
    assert engine.quantized.describe() == (
        f"model.quantize = auto: int4 (15 layers keep the GGUF's blocks (15 {kind}); linear tensors in the file: "
        f"15 {kind})")
    source = resolve_model(str(path))
    reference, _ = load_gguf_blocks(source, gguf_config(source), torch.float32, "sdpa")  # transformers' attention
    served = greedy(engine)
    assert served == [hf_greedy(reference, p, 10) for p in PROMPTS]
    for i, prompt in enumerate(PROMPTS):
        assert greedy(engine, [prompt]) == [served[i]]
