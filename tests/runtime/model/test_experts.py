"""Routed experts in the lean decoder (runtime.model.experts), on the Qwen3-MoE replica
(tests/replicas/families.py): transformers' reference loop's bits over its own weights, every row its
own bits over ponder's kernels (float and int4), so batch invariance is served."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.model.experts import KernelExperts, KernelRouter, RoutedMLP, hold_experts
from runtime.model.float_layers import FloatLinear
from runtime.model.quantize import Int4Linear
from tests.replicas.families import EXPERTS_PER_TOKEN, NUM_EXPERTS, write_family
from tests.runtime.engine_helpers import engine_for, request, run
from tests.runtime.model.test_decoder import LONG_PROMPT, recorded_logits, stack_against_loop

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 5, 6, 7, 8, 9, 20, 21], [1, 40]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_family("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


def sampled(engine, prompts=PROMPTS, first_seed=0):
    requests = [request(str(i), p, max_tokens=6, temperature=0.8, seed=first_seed + i, n=2, logprobs=True,
                        top_logprobs=3) for i, p in enumerate(prompts)]
    return run(engine, requests)


def test_the_lean_forward_gives_transformers_reference_loop_bits(moe_dir):
    """Over transformers' own stacked weights (`quantize = "none"`), the lean decoder's routed MLP gives
    the very logits of transformers' forward running its reference experts loop."""
    results, logits = [], []
    for lean in (True, False):
        engine = engine_for(moe_dir, quantize="none", batch_invariant=False, num_blocks=64)
        decoder = engine.runner.decoder
        assert decoder is not None and all(layer.moe is not None for layer in decoder.layers)
        if not lean:
            engine.runner.model.set_experts_implementation("eager")
            engine.runner.decoder = None
        logits.append(recorded_logits(engine))
        results.append(sampled(engine))
    assert results[0] == results[1]
    assert len(logits[0]) == len(logits[1]) == 6
    assert all(torch.equal(a, b) for a, b in zip(*logits))


def test_transformers_reference_loop_is_under_test(moe_dir):
    """Routing every token to the first experts instead changes the logits: the test above holds the
    routing (softmax, top-k, renormalised weights) and the expert mixing, not just the attention."""
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32, experts_implementation="eager").eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        expected = model(ids).logits
        for layer in model.model.layers:
            layer.mlp.gate.norm_topk_prob = False
        assert not torch.allclose(model(ids).logits, expected, atol=1e-4)


@pytest.mark.parametrize("mode, kind", [("float", FloatLinear), ("int4", Int4Linear)])
def test_a_row_s_bits_do_not_depend_on_the_rows_beside_it(moe_dir, mode, kind):
    """Over kernel experts, a row computed alone and in a batch whose other rows share its experts (and
    add others) gives the same bits; the kernel experts compute what the stacked weights do."""
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32, experts_implementation="eager").eval()
    mlp = model.model.layers[0].mlp
    reference = RoutedMLP(mlp)
    assert hold_experts(model, mode) == 2 * NUM_EXPERTS * len(model.model.layers)
    assert isinstance(mlp.experts, KernelExperts) and isinstance(mlp.gate, KernelRouter)
    routed = RoutedMLP(mlp)
    assert routed.all_kernel(kind)
    x = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    _, indices = mlp.gate(x)[1:]
    assert indices.shape == (40, EXPERTS_PER_TOKEN) and len(indices.unique()) == NUM_EXPERTS
    crowd = routed(x)
    for row in range(len(x)):
        assert torch.equal(routed(x[row:row + 1])[0], crowd[row]), row
    # the same experts as the stacked weights: float within rounding, int4 within its quantization
    close = reference(x)
    tolerance = 1e-5 if mode == "float" else 0.1
    assert (crowd - close).abs().max() <= tolerance * close.abs().max()
    # transformers' forward runs the kernel modules too (their forward is its experts' signature)
    with torch.no_grad():
        assert torch.equal(mlp(x[None])[0], crowd)


@pytest.mark.parametrize("quantize", ["auto", "int4"])
def test_batch_invariance_is_served_over_kernel_experts(moe_dir, quantize):
    """`batch_invariant = true` starts (no stacked weight is left), and seeded sampled requests alone
    give the tokens they give in a crowd of others."""
    engine = engine_for(moe_dir, quantize=quantize, batch_invariant=True, num_blocks=64)
    decoder = engine.runner.decoder
    kind = Int4Linear if quantize == "int4" else FloatLinear
    assert all(layer.moe.all_kernel(kind) for layer in decoder.layers) and decoder.int4 == (quantize == "int4")
    crowd = sampled(engine)
    for i, prompt in enumerate(PROMPTS):
        alone = sampled(engine_for(moe_dir, quantize=quantize, batch_invariant=True, num_blocks=64), [prompt], i)["0"]
        assert alone["choices"] == crowd[str(i)]["choices"], i


@pytest.mark.parametrize("mode, dtype", [("int4", "auto"), ("auto", "auto"), ("auto", "bfloat16")])  # auto:
@pytest.mark.parametrize("invariant", [True, False])  # every projection and expert in ponder's float kernel
def test_the_stack_kernel_gives_the_python_loop_s_bits(moe_dir, invariant, mode, dtype):
    """A step whose every row the decode kernel attends runs the whole stack, routed experts and all, in
    one kernel call (LayerStack); the Python loop (RoutedMLP over the same kernel layers) gives the very
    same logits and tokens (a bfloat16 model too)."""
    def routed_everywhere(decoder) -> None:
        assert all(layer.moe is not None for layer in decoder.layers) and len(decoder.stack.experts) == \
            6 * NUM_EXPERTS * len(decoder.layers)
        # int4 experts: the block in ponder's own arithmetic (routed_int4.cpp) in both; float ones: ATen's
        assert all((layer.moe.int4_tensors is not None) == (mode == "int4") for layer in decoder.layers)

    results, logits, covered, _ = stack_against_loop(moe_dir, mode, dtype, invariant, [*PROMPTS, LONG_PROMPT],
                                                     routed_everywhere)
    assert results[0] == results[1]
    assert len(logits[0]) == len(logits[1]) and all(torch.equal(a, b) for a, b in zip(*logits))
    # Under batch invariance the prompts are attended by the decode kernel too: every step is covered.
    assert all(covered) if invariant else covered.count(True) == len(covered) - 1


def test_the_stack_kernel_is_under_test(moe_dir):
    """Routing every token by unnormalised top-k weights in the stack kernel alone changes its logits:
    the test above holds the kernel's routing, not only its attention and its dense parts."""
    logits = []
    for renormalise in (True, False):
        engine = engine_for(moe_dir, batch_invariant=True, num_blocks=64)
        stack = engine.runner.decoder.stack
        if not renormalise:  # the last size of each layer: 1 if its top-k weights are renormalised
            stack.sizes = [0 if i % 9 == 8 else size for i, size in enumerate(stack.sizes)]
        logits.append(recorded_logits(engine))
        run(engine, [request("0", PROMPTS[0], max_tokens=2)])
    assert len(logits[0]) == len(logits[1]) == 2 and not torch.equal(logits[0][0], logits[1][0])


@pytest.mark.parametrize("quantize", ["auto", "int4"])
def test_the_stack_kernel_on_the_avx2_path_gives_the_same_bits(moe_dir, quantize):
    from runtime.kernels import cpu_kernels

    logits = []
    for isa in ("auto", "avx2"):
        cpu_kernels.use_isa(isa)
        try:
            engine = engine_for(moe_dir, quantize=quantize, batch_invariant=True, num_blocks=64)
            assert engine.runner.decoder.stack is not None
            logits.append(recorded_logits(engine))
            run(engine, [request(str(i), p, max_tokens=9) for i, p in enumerate(PROMPTS)])
        finally:
            cpu_kernels.use_isa("auto")
    assert len(logits[0]) == len(logits[1]) == 9 and all(torch.equal(a, b) for a, b in zip(*logits))
