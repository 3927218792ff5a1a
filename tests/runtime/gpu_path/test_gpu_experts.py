"""Routed experts on a GPU with their GGUF blocks kept (runtime.model.gpu_experts, the routed Triton
kernels of runtime/kernels/gpu/routed.py), here on the CPU in Triton's interpreter: the per-expert
loop's sums, each token's bits its own whatever the batch, and a MoE file's tokens as transformers
gives them from the file dequantized."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.model.experts import SiluGLU, mix_experts
from runtime.model.gpu_blocks import GpuBlockLinear
from runtime.model.gpu_experts import GpuExperts, GpuFloatLinear, gpu_experts
from tests.gguf_model import blocks_of
from tests.runtime.gpu_path.test_gpu_blocks_load import CPU, expected_bytes

EXPERTS, TOP_K, HIDDEN, INNER = 4, 2, 256, 256


def expert_layers(kind: str, seed: int) -> tuple[list, list, list]:
    """Each of `EXPERTS` experts' gate, up and down layers of `kind`'s random blocks."""
    from runtime.model.gpu_blocks import gpu_block_layer

    def layer(n: int, rows: int, cols: int) -> GpuBlockLinear:
        data = blocks_of(kind, rows, cols, seed=seed + n)
        return gpu_block_layer(kind, lambda start, stop: data[start:stop], (rows, cols), CPU)

    return ([layer(3 * e, INNER, HIDDEN) for e in range(EXPERTS)], [layer(3 * e + 1, INNER, HIDDEN) for e in range(EXPERTS)],
            [layer(3 * e + 2, HIDDEN, INNER) for e in range(EXPERTS)])


def routing(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=generator), dim=-1)
    return indices, weights


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
def test_the_routed_kernels_sum_what_the_per_expert_loop_sums_and_a_token_s_bits_are_its_own(kind):
    """Two launches (SiLU(gate) * up an expert a token; down, weighted and summed in ascending expert order)
    against one block GEMM a layer an expert hit; a token's outputs the same bits alone as beside others."""
    gate, up, down = expert_layers(kind, seed=11)
    loop = GpuExperts([GpuBlockLinear.concatenated([g, u]) for g, u in zip(gate, up)], down, nn.SiLU())
    assert loop.stacks is None  # (no stacks given: the per-expert loop)
    experts = gpu_experts(gate, up, down, nn.SiLU())
    assert experts.stacks is not None
    stacked_gate_up, stacked_down = experts.stacks
    assert stacked_gate_up.codes.shape[:2] == (EXPERTS, 2 * INNER) and stacked_down.codes.shape[:2] == (EXPERTS, HIDDEN)
    # each expert's layer a view of its slice of the stack (the stack holds the one copy)
    assert experts.down[1].weight.data_ptr() == stacked_down.codes[1].data_ptr()
    assert experts.gate_up[2].weight.data_ptr() == stacked_gate_up.codes[2].data_ptr()
    assert gate[2].weight.data_ptr() == stacked_gate_up.codes[2].data_ptr()  # (the gate: its first rows)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    indices, weights = routing(3)
    routed = experts(x, indices, weights)
    calls = [(g.rows, d.rows) for g, d in zip(experts.gate_up, experts.down)]
    # (SiLU's exp is Triton's there, torch's here: the last bits of a few sums differ)
    scale = routed.abs().max().item()
    torch.testing.assert_close(routed, mix_experts(x, indices, weights, calls, SiluGLU(nn.SiLU())),
                               rtol=1e-5, atol=1e-6 * scale)
    torch.testing.assert_close(routed, loop(x, indices, weights), rtol=1e-5, atol=1e-6 * scale)
    assert torch.equal(experts(x[1:2], indices[1:2], weights[1:2]), routed[1:2])
    assert torch.equal(experts(x[:2], indices[:2], weights[:2]), routed[:2])
    # the token's experts in the other order: the same sums in the same (ascending) order
    assert torch.equal(experts(x[1:2], indices[1:2].flip(-1), weights[1:2].flip(-1)), routed[1:2])


def test_layers_of_two_forms_are_not_stacked_and_run_the_per_expert_loop():
    """A gate of Q4_K beside an up of Q6_K cannot share one kernel's form: each expert's gate and up side by
    side (two calls), the same sums."""
    gate, _, down = expert_layers("Q4_K", seed=5)
    _, up, _ = expert_layers("Q6_K", seed=5)
    experts = gpu_experts(gate, up, down, nn.SiLU())
    assert experts.stacks is None
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(2))
    indices, weights = routing(2, seed=3)
    calls = [(g.rows, d.rows) for g, d in zip(experts.gate_up, experts.down)]
    expected = mix_experts(x, indices, weights, [(lambda r, g=g, u=u: torch.cat([g.rows(r), u.rows(r)], -1), d.rows)
                                                  for g, u, d in zip(gate, up, down)], SiluGLU(nn.SiLU()))
    assert torch.equal(experts(x, indices, weights), expected)
    assert len(calls) == EXPERTS


def test_a_moe_gguf_for_a_gpu_keeps_its_experts_blocks_and_gives_its_dequantized_tokens(tmp_path):
    """A Qwen3-MoE file of Q8_0 tensors loaded for a GPU: every block's experts stacked in the file's
    bytes for the routed kernels, the router in the Triton float GEMV, and the tokens (and logits) of
    the same file dequantized by transformers."""
    from runtime.model.cached_model import gguf_config
    from runtime.model.experts import KernelRouter
    from runtime.model.gguf_load import load_gguf_blocks
    from runtime.model.loader import load_causal_lm, resolve_model
    from tests.gguf_moe import write_qwen3_moe_gguf
    from tests.replicas.families import write_family
    from tests.runtime.engine_helpers import hf_greedy

    path = write_qwen3_moe_gguf(write_family("qwen3_moe", tmp_path / "replica"), tmp_path / "moe.gguf", "Q8_0")
    source = resolve_model(str(path))
    reference = load_causal_lm(source, CPU, torch.float32, "sdpa")
    model, quantized = load_gguf_blocks(source, gguf_config(source), torch.float32, "sdpa", device=CPU)
    assert quantized.mode == "gpu_blocks"
    for i, layer in enumerate(model.model.layers):
        experts, router = layer.mlp.experts, layer.mlp.gate
        assert isinstance(experts, GpuExperts) and experts.stacks is not None
        assert isinstance(router, KernelRouter) and isinstance(router.linear, GpuFloatLinear)
        stacked = reference.model.layers[i].mlp.experts
        inner, hidden = stacked.down_proj.shape[2], stacked.down_proj.shape[1]
        assert experts.nbytes == stacked.num_experts * (expected_bytes("Q8_0", 2 * inner, hidden)
                                                          + expected_bytes("Q8_0", hidden, inner))
        for e in range(stacked.num_experts):  # the file's weights exactly
            assert torch.equal(experts.gate_up[e].dequantized(), stacked.gate_up_proj[e])
            assert torch.equal(experts.down[e].dequantized(), stacked.down_proj[e])
    prompt = [1, 5, 6, 7, 8]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)
    assert hf_greedy(model, prompt, 4) == hf_greedy(reference, prompt, 4)


def test_experts_of_a_type_the_blocks_do_not_cover_are_refused_so_the_model_loads_dequantized(tmp_path):
    """F32 experts have no block layers on a GPU: the GPU path refuses the file, naming the type, and the
    start-up path loads it through transformers."""
    from runtime.model.cached_model import gguf_config
    from runtime.model.gguf_load import load_gguf_blocks
    from runtime.model.loader import CheckpointMismatch, resolve_model
    from tests.gguf_moe import write_qwen3_moe_gguf
    from tests.replicas.families import write_family

    path = write_qwen3_moe_gguf(write_family("qwen3_moe", tmp_path / "replica"), tmp_path / "moe.gguf", "F32")
    source = resolve_model(str(path))
    with pytest.raises(CheckpointMismatch, match="routed experts of type F32 are not kept on a GPU"):
        load_gguf_blocks(source, gguf_config(source), torch.float32, "sdpa", device=CPU)


@pytest.fixture(scope="module")
def moe_q8_0(tmp_path_factory):
    from tests.gguf_moe import write_qwen3_moe_gguf
    from tests.replicas.families import write_family

    directory = tmp_path_factory.mktemp("qwen3-moe-q8_0")
    return write_qwen3_moe_gguf(write_family("qwen3_moe", directory / "replica"), directory / "moe.gguf", "Q8_0")


SERVED = [[1, 5, 6, 7, 8], [1, 40, 41]]


def served(path, monkeypatch, graphs: bool = False):
    """(the tokens of a Qwen3-MoE file dequantized, served by transformers' float model; an engine as a
    GPU serves the file, its blocks kept (the start-up flag set here on the CPU), its decode steps in the
    Triton loop, or with `graphs` from the static buffers a CUDA graph replays, run eagerly)."""
    import functools

    from runtime.model.cached_model import load_quantized_model
    from tests.runtime.engine_helpers import engine_for, request, run

    requests = [request(str(i), prompt, max_tokens=4) for i, prompt in enumerate(SERVED)]
    # (transformers' stacked experts keep no batch invariance: the reference runs without it)
    expected = run(engine_for(path, quantize="none", num_blocks=32, batch_invariant=False), requests)
    monkeypatch.setattr("runtime.bootstrap.load_quantized_model", functools.partial(load_quantized_model, gpu_blocks=True))
    engine = engine_for(path, num_blocks=32)  # quantize left at auto; batch invariance on (the probe accepts it)
    engine.runner.use_gpu_kernels()
    assert engine.quantized.mode == "gpu_blocks" and engine.runner.decoder.gpu is not None
    assert not graphs or engine.runner.use_graphs(capture=False, max_rows=4)
    return expected, engine, requests


def test_a_moe_gguf_served_with_its_blocks_kept_decodes_in_the_triton_loop_to_the_dequantized_tokens(moe_q8_0,
                                                                                                      monkeypatch):
    """The lean decoder's Triton loop takes the routed layers (router, routing, the experts' two launches),
    and the greedy tokens are the file's dequantized ones, a request's the same alone as beside others."""
    from runtime.model import gpu_layers
    from tests.runtime.engine_helpers import run

    expected, engine, requests = served(moe_q8_0, monkeypatch)
    moe = engine.runner.decoder.layers[0].moe
    assert isinstance(moe.modules[0][0], GpuBlockLinear) and moe.experts.stacks is not None
    steps, call = [], gpu_layers.GpuLayers.__call__
    monkeypatch.setattr(gpu_layers.GpuLayers, "__call__", lambda self, hidden, *a, **k: steps.append(1) or
                        call(self, hidden, *a, **k))
    assert run(engine, requests) == expected
    assert len(steps) == 4  # (every step: exact prefill attends prompt tokens one query at a time too)
    assert run(engine, requests[1:]) == {"1": expected["1"]}


def test_a_moe_gguf_s_static_buffer_steps_give_the_same_tokens(moe_q8_0, monkeypatch):
    """The step a CUDA graph replays (its CPU twin) over the routed layers: the same tokens."""
    from runtime.model.graphs import DecodeGraphs
    from tests.runtime.engine_helpers import run

    expected, engine, requests = served(moe_q8_0, monkeypatch, graphs=True)
    sizes, step = [], DecodeGraphs._step
    monkeypatch.setattr(DecodeGraphs, "_step", lambda self, size: sizes.append(size) or step(self, size))
    assert run(engine, requests) == expected
    assert sizes == [engine.runner.padding.pad(2)] * 3


def test_a_routed_decode_layer_is_ten_launches(moe_q8_0, monkeypatch):
    """A routed layer of the Triton loop, counted on the CPU: the router's matmul, its routing and the
    experts' two launches where a dense layer's gate/up, SiLU * mul and down are."""
    from runtime.kernels.gpu import linear
    from runtime.model import gpu_layers
    from tests.runtime.engine_helpers import request
    from tests.runtime.gpu_path.test_gpu_layers import decode_launches

    _, engine, _ = served(moe_q8_0, monkeypatch)
    steps = decode_launches(engine, monkeypatch, [request("a", SERVED[0], max_tokens=3)],
                            kernels=("rms_norm", "attention_inputs", "decode_attention", "route_rows", "routed_mlp"),
                            functions=((linear, "block_linear"), (linear, "linear")))
    layer = ["rms_norm", "block_linear", "attention_inputs", "decode_attention", "block_linear", "rms_norm", "linear",
             "route_rows", "routed_mlp"]
    assert steps[-1] == ["aten.zeros.default"] + layer * len(engine.runner.decoder.layers) + ["rms_norm"]
    assert gpu_layers.route_rows.__name__ == "kernel"  # (counted: the loop's own names were patched)


def test_the_routing_kernel_routes_as_the_router_in_ascending_expert_order():
    """Softmax over every expert in float32, the top k, renormalised or not: torch's choice of experts
    (no two logits equal here) in ascending order, and their weights within float32's last bits."""
    from runtime.kernels.gpu.routed import route_rows
    from runtime.model.experts import route

    generator = torch.Generator().manual_seed(0)
    for experts, top_k, renormalise in ((4, 2, True), (128, 8, True), (60, 4, False)):
        logits = torch.randn(5, experts, generator=generator)
        chosen, weights = route_rows(logits, top_k, renormalise)
        torch_weights, torch_chosen = route(logits, top_k, renormalise)
        ascending, order = torch_chosen.sort(dim=-1)
        assert chosen.dtype == torch.int32 and torch.equal(chosen.long(), ascending)
        torch.testing.assert_close(weights, torch_weights.gather(-1, order), rtol=1e-6, atol=1e-7)
        assert torch.equal(route_rows(logits[2:3], top_k, renormalise)[1], weights[2:3])  # (a row's own bits)
    ties = torch.zeros(1, 8)  # equal logits: the lowest ids (torch.topk leaves the choice open)
    assert route_rows(ties, 3, True)[0].tolist() == [[0, 1, 2]]


def test_gpt_oss_s_mxfp4_experts_on_a_gpu_keep_their_blocks_and_biases_and_give_the_dequantized_tokens(tmp_path):
    """gpt-oss's biased, clamped experts (MXFP4_MOE's MXFP4 experts beside Q8_0 layers) keep the file's
    blocks on a GPU and run one block GEMM a layer an expert hit (the routed kernels compute SiLU(gate) *
    up only), each expert's gate and up side by side with their biases: the tokens of the same file as
    transformers dequantizes it."""
    from transformers import AutoModelForCausalLM

    from runtime.model.cached_model import gguf_config
    from runtime.model.gguf_load import load_gguf_blocks
    from runtime.model.loader import resolve_model
    from tests.gguf_gpt_oss import dequantized_replica, write_gpt_oss_gguf
    from tests.replicas.families import write_family
    from tests.runtime.engine_helpers import hf_greedy

    replica = write_family("gpt_oss", tmp_path / "replica")
    path = write_gpt_oss_gguf(replica, tmp_path / "gpt-oss-MXFP4_MOE.gguf")
    reference = AutoModelForCausalLM.from_pretrained(dequantized_replica(replica, path, tmp_path / "dequantized"),
                                                     dtype=torch.float32, experts_implementation="eager").eval()
    source = resolve_model(str(path))
    model, quantized = load_gguf_blocks(source, gguf_config(source), torch.float32, "eager", device=CPU)
    assert quantized.mode == "gpu_blocks" and "MXFP4" in quantized.block_types
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, GpuExperts) and experts.stacks is None
    assert experts.gate_up[0].bias is not None and isinstance(experts.down[0], GpuBlockLinear)
    prompt = [1, 5, 6, 7, 8]
    assert hf_greedy(model, prompt, 4) == hf_greedy(reference, prompt, 4)
