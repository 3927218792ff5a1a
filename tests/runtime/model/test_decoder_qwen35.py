"""Qwen3.5's text model (qwen3_5_text) in the lean decoder (runtime.model.qwen35_layers): its Gated DeltaNet
layers (fused in-projections, the recurrent code transformers' forward runs too, the gated norm with z), its
gated full attention (queries and gates from one projection, (1 + w) q/k norms, partial interleaved mrope)
and its (1 + w) norms give transformers' forward's bits, whatever kind of linear layer computes the
projections. (Greedy tokens against transformers' `generate`, seeds alone and in a crowd, the prefix cache
and searches: tests/runtime/model/test_hybrid_recurrent.py, which now runs this decoder.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from runtime.model.decoders import build_decoder
from runtime.model.float_layers import FloatLinear
from runtime.model.qwen35_layers import HybridDecoder, RunProjections, _AttentionLayer, _DeltaLayer
from runtime.model.quantize import Int4Linear, Int8Linear
from runtime.model.row_padding import executed_linears
from runtime.model.shared_experts import SharedExpertMoE
from tests.replicas.hybrid import write_qwen3_next, write_qwen35
from tests.runtime.engine_helpers import engine_for, request, run
from tests.runtime.model.test_decoder import lean_then_transformers, recorded_logits, stack_against_loop
from tests.runtime.model.test_replica_generators import prompt_ids

LINEAR = {"none": nn.Linear, "int8": Int8Linear, "int4": Int4Linear, "auto": FloatLinear}
LONG = [{"role": "user", "content": "Tom has 5 apples and buys 3 more. Janet has 3 ducks and they lay 16 eggs "
                                    "a day. She eats three for breakfast. How many eggs are left?"}]


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return write_qwen35(tmp_path_factory.mktemp("qwen35_lean"))


@pytest.fixture(scope="module")
def qwen35_moe(tmp_path_factory):
    return write_qwen35(tmp_path_factory.mktemp("qwen35_moe_lean"), moe=True)


def lean_and_transformers(directory, mode, dtype, invariant, fused_norms=True):
    """(results, logits) of the engine with its lean forward, then with transformers' forward (ponder's
    recurrent layers in it; stacked experts in its reference loop, `experts_implementation = "eager"`),
    the same sampled requests with log-probabilities. `fused_norms=False`: the int4 layers' loop with the
    norms and residual adds in torch, as transformers computes them."""
    prompts = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 40], prompt_ids(directory, LONG)]

    def check(engine):
        decoder = engine.runner.decoder
        assert isinstance(decoder, HybridDecoder)
        if engine.runner.model.config.model_type == "qwen3_5_moe_text":
            engine.runner.model.set_experts_implementation("eager")
        kinds = [type(layer).__name__ for layer in decoder.layers]
        assert kinds == ["_DeltaLayer"] * 3 + ["_AttentionLayer"]
        for layer in decoder.layers:  # every projection fused into layers of the mode's kind
            assert type(layer.qkv.fused) is LINEAR[mode] and type(layer.gate_up.fused) is LINEAR[mode]
            layer.int4 = layer.int4 and fused_norms
        assert decoder.int4 == (mode == "int4")
        if not fused_norms:  # (the stack kernel runs the fused loop's operators)
            decoder.stack = None

    return lean_then_transformers(directory, prompts, check, quantize=mode, dtype=dtype, batch_invariant=invariant,
                                  num_blocks=128)


@pytest.mark.parametrize("mode, dtype, invariant", [
    ("none", "float32", True), ("none", "float32", False), ("int8", "float32", True), ("int4", "float32", True),
    ("auto", "float32", True), ("auto", "bfloat16", True), ("none", "bfloat16", False)])
def test_the_lean_forward_gives_transformers_bits(qwen35, mode, dtype, invariant):
    results, logits = lean_and_transformers(qwen35, mode, dtype, invariant, fused_norms=False)
    assert results[0] == results[1]
    assert all(torch.equal(a, b) for a, b in zip(*logits))


@pytest.mark.parametrize("invariant", [True, False])
def test_int4_layers_with_their_norms_and_residuals_fused_stay_close_to_transformers(qwen35, invariant):
    # As tests/runtime/model/test_decoder.py's: the int4 kernel computes the (1 + w) norm before a
    # projection and the residual add after it in its own order, and rounds its inputs to int8 per group
    # of 32, so a last-bit difference may move one input across a rounding boundary. Here a token's
    # difference stays in the recurrent state of every layer after it, so it is seen in every later row
    # of its sequence (the long prompt's: about 1 % of the logits' scale), where an attention layer's
    # stays in that token's keys and values.
    _, logits = lean_and_transformers(qwen35, "int4", "float32", invariant)
    for a, b in zip(*logits):
        scale = b.abs().max().item()
        assert bool(((a - b).abs().amax(-1) <= 2e-2 * scale).all())
    assert any(not torch.equal(a, b) for a, b in zip(*logits))  # (the kernel's norms are under test)


@pytest.mark.parametrize("invariant", [True, False])
def test_the_stack_kernel_gives_the_int4_loop_s_bits(qwen35, invariant):
    """A step whose every row the decode kernel attends runs every layer in one `hybrid_layers` call
    (runtime.model.hybrid_stack); the int4 loop over the same kernels gives the very same logits and
    tokens, and the same recurrent states: prompts of several lengths, so that decode steps cross block
    boundaries (snapshots) and forked samples (n = 2) resume their parent's states."""
    prompts = [[1, *range(5, 5 + length)] for length in (3, 9, 14, 20)] + [prompt_ids(qwen35, LONG)]
    results, logits, covered, padded = stack_against_loop(qwen35, "int4", "float32", invariant, prompts)
    assert results[0] == results[1]
    assert len(logits[0]) == len(logits[1]) and all(torch.equal(a, b) for a, b in zip(*logits))
    # Under batch invariance the prompts are attended by the decode kernel too: every step is covered.
    assert all(covered) if invariant else covered.count(True) == len(covered) - 1
    assert padded[0] == 0


@pytest.mark.parametrize("mode, dtype, invariant", [
    ("none", "float32", False), ("auto", "float32", True), ("int4", "float32", True), ("auto", "bfloat16", True)])
def test_qwen35_moe_s_sparse_blocks_give_transformers_bits(qwen35_moe, mode, dtype, invariant):
    """Qwen3.5-MoE: the same layers, each MLP the routed experts beside the gated shared expert
    (runtime.model.shared_experts), over transformers' stacked experts (`none`) or one kernel layer an
    expert (the float kernel under `auto`, int4 ones)."""
    results, logits = lean_and_transformers(qwen35_moe, mode, dtype, invariant, fused_norms=False)
    decoder = build_decoder(AutoModelForCausalLM.from_pretrained(qwen35_moe, dtype=torch.float32).eval())
    assert all(isinstance(layer.moe, SharedExpertMoE) for layer in decoder.layers)
    assert results[0] == results[1]
    assert all(torch.equal(a, b) for a, b in zip(*logits))


def test_a_sparse_block_is_under_test(qwen35_moe):
    """The shared expert's gate counts: one computed otherwise (its logit doubled) changes the logits."""
    engine = engine_for(qwen35_moe, num_blocks=64)
    logits = recorded_logits(engine)
    run(engine, [request("a", [1, 5, 6, 7], max_tokens=2)])
    moe = engine.runner.decoder.layers[0].moe
    gate = moe.shared_gate
    moe.shared_gate = lambda x: 2 * gate(x)
    run(engine, [request("b", [1, 5, 6, 7], max_tokens=2)])
    assert not torch.equal(logits[0], logits[2])


def test_the_lean_forward_is_under_test(qwen35):
    """The engine's steps run the lean decoder's layers: one computed otherwise (the attention's output
    doubled) changes the logits."""
    engine = engine_for(qwen35, num_blocks=64)
    attention = next(layer for layer in engine.runner.decoder.layers if isinstance(layer, _AttentionLayer))
    logits = recorded_logits(engine)
    run(engine, [request("a", [1, 5, 6, 7], max_tokens=2)])
    o_proj = attention.o_proj
    attention.o_proj = lambda x: o_proj(2 * x)
    run(engine, [request("b", [1, 5, 6, 7], max_tokens=2)])
    assert not torch.equal(logits[0], logits[2])


def test_the_in_projections_fuse_in_runs_of_one_format():
    """A Q4_K_M file's Gated DeltaNet in-projections: in_proj_qkv in Q8_0, the others in Q5_0, b and a 6
    columns each. Fused without widening any layer's codes: qkv alone, z with b (b's part-empty column
    block last), a alone; every output the layer's own bits."""
    torch.manual_seed(0)
    layers = [Int4Linear.from_linear(nn.Linear(64, rows, bias=False)) for rows in (96, 32, 6, 6)]
    layers[0].widen(torch.float16, True)  # 8-bit codes, as a Q8_0 layer's
    x = torch.randn(3, 64)
    separate = [layer(x) for layer in layers]
    projections = RunProjections(layers)
    assert [run.sizes for run in projections.runs] == [[96], [32, 6], [6]]
    assert [layer.bits for layer in layers] == [8, 4, 4, 4] and projections.runs[1].fused.bits == 4
    assert all(torch.equal(a, b) for a, b in zip(projections(x), separate))


def test_row_padding_probes_the_fused_layers(qwen35):

    model = AutoModelForCausalLM.from_pretrained(qwen35, dtype=torch.float32).eval()
    decoder = build_decoder(model)  # (the decoder the runner and the probe share)
    assert isinstance(decoder, HybridDecoder)
    probed = {id(layer) for layer in executed_linears(model)}
    for layer in decoder.layers:
        assert id(layer.qkv.fused) in probed and id(layer.gate_up.fused) in probed
    delta = next(layer for layer in decoder.layers if isinstance(layer, _DeltaLayer))
    # torch's matmuls: in_proj_b and in_proj_a (4 columns) are called alone, as transformers calls them
    assert [run.sizes for run in delta.in_proj.runs] == [[128, 64], [4], [4]]


def test_other_hybrid_families_keep_transformers_forward(tmp_path):
    """Qwen3-Next stays on transformers' forward, with ponder's recurrent layers."""
    engine = engine_for(write_qwen3_next(tmp_path / "next"), batch_invariant="auto")
    assert engine.runner.decoder is None and engine.runner.recurrent is not None


def test_the_delta_kernel_gives_a_token_the_same_bits_alone_or_in_a_prompt():
    """ponder's Gated DeltaNet kernel splits a prompt's heads between threads and runs a decode step's on
    one: 20 tokens in one call and the same tokens one call each (the state handed on) give the same
    outputs and final state, bit for bit."""
    from runtime.kernels.cpu_kernels import KernelUnavailable, gated_delta_kernel

    try:
        kernel = gated_delta_kernel()
    except KernelUnavailable as exc:
        pytest.skip(str(exc))
    g = torch.Generator().manual_seed(0)
    hk, hv, dk, dv, width, n = 2, 4, 64, 64, 4, 20
    channels = 2 * hk * dk + hv * dv
    window = torch.randn(width - 1 + n, channels, generator=g)
    taps, a, b = torch.randn(width, channels, generator=g), torch.randn(n, hv, generator=g), torch.randn(n, hv, generator=g)
    dt_bias, a_log = torch.randn(hv, generator=g), torch.rand(hv, generator=g)
    state = torch.randn(hv, dk, dv, generator=g)
    whole = torch.zeros(n, hv, dv)
    final, at_7 = kernel(window, taps, torch.empty(0), a, b, dt_bias, a_log, state, hk, dk, dv, [7], whole)
    alone = torch.zeros(n, hv, dv)
    for t in range(n):
        state, = kernel(window[t:t + width].contiguous(), taps, torch.empty(0), a[t:t + 1].contiguous(),
                        b[t:t + 1].contiguous(), dt_bias, a_log, state, hk, dk, dv, [], alone[t:t + 1])
        if t == 6:
            assert torch.equal(state, at_7)
    assert torch.equal(alone, whole) and torch.equal(state, final)
