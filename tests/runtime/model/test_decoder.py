import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, GemmaConfig, GemmaForCausalLM

from runtime.model.decoder import LeanDecoder
from runtime.model.projections import Projections, fuse_linears
from runtime.model.quantize import Int4Linear, Int8Linear, quantize_model
from tests.runtime.engine_helpers import engine_for, request, run

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 5, 6, 7, 8, 9, 20, 21], [1, 40]]
LONG_PROMPT = [1] + [5 + (7 * i) % 70 for i in range(49)]


@pytest.fixture(params=["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_smollm3"])
def model_dir(request):
    return request.getfixturevalue(request.param)


def recorded_logits(engine):
    """Every logits tensor the engine's runner returns, in order."""
    seen = []
    execute = engine.runner.execute

    def record(*args, **kwargs):
        logits = execute(*args, **kwargs)
        seen.append(logits.clone())
        return logits

    engine.runner.execute = record
    return seen


def lean_then_transformers(model_dir, prompts, check=lambda engine: None, **engine_args):
    """(results, logits) of the engine with its lean forward, then with transformers' forward: the same
    sampled requests with log-probabilities over `prompts`; `check(engine)` first, on each engine."""
    results, logits = [], []
    for lean in (True, False):
        engine = engine_for(model_dir, **engine_args)
        check(engine)
        if not lean:
            engine.runner.decoder = None
        logits.append(recorded_logits(engine))
        requests = [request(str(i), p, max_tokens=9, temperature=0.8, seed=i, n=2, logprobs=True, top_logprobs=3)
                    for i, p in enumerate(prompts)]
        results.append(run(engine, requests))
    assert len(logits[0]) == len(logits[1]) == 9  # a prefill step, then one step a token
    return results, logits


def lean_and_transformers(model_dir, mode, invariant):
    """(results, logits) of the engine with its lean forward, then with transformers' forward."""
    def check(engine):
        assert engine.runner.decoder is not None and engine.runner.decoder.int4 == (mode == "int4")

    return lean_then_transformers(model_dir, PROMPTS, check, quantize=mode, batch_invariant=invariant, num_blocks=64)


@pytest.mark.parametrize("mode", ["none", "int8"])
@pytest.mark.parametrize("invariant", [True, False])
def test_the_lean_forward_gives_transformers_bits(model_dir, mode, invariant):
    results, logits = lean_and_transformers(model_dir, mode, invariant)
    assert results[0] == results[1]
    assert all(torch.equal(a, b) for a, b in zip(*logits))


@pytest.mark.parametrize("invariant", [True, False])
def test_int4_layers_with_their_norms_and_residuals_fused_stay_close_to_transformers(model_dir, invariant):
    # The int4 kernel also computes the norm before a projection and the residual add after it, in its
    # own order: the logits may differ from transformers' operators in the last bits. It rounds its
    # inputs to int8 per group of 32, so a last-bit difference may move one input across a rounding
    # boundary: a row then differs by about one int8 step (Qwen3's q/k norms make a few such rows; the
    # lean and the transformers forward each differ so from themselves when only the batch changes).
    _, logits = lean_and_transformers(model_dir, "int4", invariant)
    flipped = 0
    for a, b in zip(*logits):
        scale = b.abs().max().item()
        rows = (a - b).abs().amax(-1)
        assert bool((rows <= 5e-3 * scale).all())
        flipped += int((rows > 2e-5 * scale).sum())
    assert flipped <= 2


def stack_against_loop(model_dir, mode: str, dtype: str, invariant: bool, prompts, check=lambda decoder: None):
    """The same sampled requests (logprobs too) served twice, first with the decoder's stack kernel,
    then with its Python loop; returns (their results, the logits each step gave, whether the stack
    covered each step, each step's padded rows). `check(decoder)` looks at each engine's decoder first."""
    results, logits, covered, padded = [], [], [], []
    for stack in (True, False):
        engine = engine_for(model_dir, quantize=mode, dtype=dtype, batch_invariant=invariant, num_blocks=64)
        decoder = engine.runner.decoder
        assert decoder.stack is not None and (decoder.int4, decoder.floats) == (mode == "int4", mode == "auto")
        assert engine.runner.cache.dtype == (torch.bfloat16 if dtype == "bfloat16" else torch.float32)
        check(decoder)
        if stack:
            covers = decoder.stack.covers
            decoder.stack.covers = lambda meta: padded.append(meta.num_padding) or covered.append(covers(meta)) \
                or covered[-1]
        else:
            decoder.stack = None
        logits.append(recorded_logits(engine))
        requests = [request(str(i), p, max_tokens=9, temperature=0.8, seed=i, n=2, logprobs=True, top_logprobs=3)
                    for i, p in enumerate(prompts)]
        results.append(run(engine, requests))
    return results, logits, covered, padded


@pytest.mark.parametrize("mode, dtype", [("int4", "auto"), ("auto", "auto"), ("auto", "bfloat16")])  # auto:
@pytest.mark.parametrize("invariant", [True, False])  # every layer in ponder's float kernel
def test_the_stack_kernel_gives_the_python_loop_s_bits(model_dir, invariant, mode, dtype):
    # A step whose every row the decode kernel attends runs the whole stack in one kernel call
    # (LayerStack); the Python loop over the same kernels must give the very same logits and tokens
    # (a bfloat16 model too: every rounding of the loop's bfloat16 operators kept).
    results, logits, covered, padded = stack_against_loop(model_dir, mode, dtype, invariant, [*PROMPTS, LONG_PROMPT])
    assert results[0] == results[1]
    assert len(logits[0]) == len(logits[1]) and all(torch.equal(a, b) for a, b in zip(*logits))
    # Under batch invariance the prompts are attended by the decode kernel too: every step is covered.
    assert all(covered) if invariant else covered.count(True) == len(covered) - 1
    # Every layer and attention is ponder's own kernel, so no step is padded, invariant or not.
    assert padded[0] == 0


def test_the_float_stack_on_the_avx2_path_gives_the_same_bits(tiny_qwen2):
    from runtime.kernels import cpu_kernels

    results = []
    for isa in ("auto", "avx2"):
        cpu_kernels.use_isa(isa)
        try:
            engine = engine_for(tiny_qwen2, batch_invariant=True, num_blocks=64)
            assert engine.runner.decoder.floats and engine.runner.decoder.stack is not None
            results.append(run(engine, [request(str(i), p, max_tokens=9) for i, p in enumerate(PROMPTS)]))
        finally:
            cpu_kernels.use_isa("auto")
    assert results[0] == results[1]


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_fused_projections_share_the_layers_weights_and_keep_their_bits(tiny_qwen2, mode):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2).eval()
    quantize_model(model, mode)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        before = model(ids).logits
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    groups = [[attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]]
    x = torch.randn(5, model.config.hidden_size)
    separate = [[layer(x) for layer in group] for group in groups]
    decoder = LeanDecoder.build(model)
    assert decoder is not None and LeanDecoder.build(model) is decoder  # built once a model: weights fused once
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # transformers' own forward still works on the views
    for group, outputs in zip(groups, separate):
        fused = fuse_linears(group)  # the layers are views after the build: this fuses them again
        assert group[0].weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
        if mode == "int4":  # the scales too
            assert group[0].d.untyped_storage().data_ptr() == fused.d.untyped_storage().data_ptr()
        assert torch.equal(fused(x), torch.cat(outputs, dim=-1))
        assert all(torch.equal(a, b) for a, b in zip(Projections(group)(x), outputs))
    assert attn.q_proj.bias is not None


def test_layers_that_cannot_be_fused_are_called_one_by_one():
    torch.manual_seed(0)
    int4 = Int4Linear.from_linear(nn.Linear(64, 32))
    per_16 = Int4Linear.from_packed(64, 32, torch.zeros(4, 8 * 64, dtype=torch.uint8), torch.ones(4, 4, 8), None)
    assert Int4Linear.concatenated([int4, per_16]) is None  # a Q6_K-like scale per 16 inputs beside one per 32
    any_rows = [Int4Linear.from_linear(nn.Linear(64, rows)) for rows in (48, 16)]
    x = torch.randn(3, 64)
    separate = torch.cat([layer(x) for layer in any_rows], dim=-1)
    assert torch.equal(Int4Linear.concatenated(any_rows)(x), separate)
    mixed = [Int8Linear(nn.Linear(64, 16)), nn.Linear(64, 16)]
    assert fuse_linears(mixed) is None
    assert fuse_linears([nn.Linear(64, 16), nn.Linear(64, 16, bias=False)]) is None
    projections = Projections([int4, *mixed])
    assert projections.fused is None
    outputs = projections(x)
    assert all(torch.equal(out, layer(x)) for out, layer in zip(outputs, [int4, *mixed]))
    joined, last = projections.split_last(x)
    assert torch.equal(joined, torch.cat(outputs[:2], dim=-1)) and torch.equal(last, outputs[2])


def test_an_architecture_it_does_not_know_keeps_transformers_forward():
    config = GemmaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    assert LeanDecoder.build(GemmaForCausalLM(config)) is None  # another architecture (GeGLU, its own norms)
    with torch.device("meta"):
        gpt2 = AutoModelForCausalLM.from_config(__import__("transformers").GPT2Config(n_layer=1))
    assert LeanDecoder.build(gpt2) is None
