"""Gemma 3's text model (gemma3_text) in the lean decoder: its (1 + w) norms, sandwich norms, GeGLU,
scaled embedding, query_pre_attn_scalar, sliding layers with their own rotary, and final soft-capping
give transformers' bits, whatever kind of linear layer computes the projections."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from runtime.model.decoder import LeanDecoder
from runtime.model.float_layers import FloatLinear
from runtime.model.norms import OffsetRMSNorm, norm_of
from runtime.model.quantize import Int4Linear, Int8Linear
from tests.conftest import VOCAB, build_tokenizer
from tests.runtime.engine_helpers import engine_for, request, run
from tests.runtime.model.test_decoder import PROMPTS, lean_then_transformers, recorded_logits

WINDOW = 8
LONG_PROMPT = [1] + [5 + (7 * i) % 70 for i in range(29)]  # past the window, and past it again as it decodes
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"]
LINEAR = {"none": torch.nn.Linear, "int8": Int8Linear, "int4": Int4Linear, "auto": FloatLinear}


def gemma3_config(**overrides) -> Gemma3TextConfig:
    """A tiny Gemma 3: head_dim not hidden / heads and query_pre_attn_scalar not head_dim (as in
    gemma-3-27b), a window of `WINDOW`, the published rope bases (1e6 global, 1e4 sliding)."""
    fields = dict(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
                  sliding_window=WINDOW, layer_types=LAYER_TYPES, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return Gemma3TextConfig(**{**fields, **overrides})


def write_gemma3(directory, **overrides):
    torch.manual_seed(4)
    model = Gemma3ForCausalLM(gemma3_config(**overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # transformers initialises them to zero: (1 + w) would be the identity
                param.uniform_(-0.5, 0.5)
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(directory, safe_serialization=True)
    build_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return write_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


def lean_and_transformers(model_dir, mode, dtype, invariant=True):
    """(results, logits) of the engine with its lean forward, then with transformers' forward."""
    def check(engine):
        decoder = engine.runner.decoder
        assert decoder is not None and engine.model.config.model_type == "gemma3_text"
        assert not decoder.kernel_form and (decoder.int4, decoder.floats, decoder.stack) == (False, False, None)
        assert all(type(layer.qkv.fused) is LINEAR[mode] and type(layer.gate_up.fused) is LINEAR[mode]
                   for layer in decoder.layers)  # every projection fused, in the mode's layers

    return lean_then_transformers(model_dir, [*PROMPTS, LONG_PROMPT], check, quantize=mode, dtype=dtype,
                                  batch_invariant=invariant, num_blocks=64)


@pytest.mark.parametrize("mode, dtype, invariant", [
    ("none", "float32", True), ("none", "float32", False), ("int8", "float32", True), ("int4", "float32", True),
    ("auto", "float32", True), ("auto", "bfloat16", True), ("none", "bfloat16", False)])
def test_the_lean_forward_gives_transformers_bits(tiny_gemma3, mode, dtype, invariant):
    results, logits = lean_and_transformers(tiny_gemma3, mode, dtype, invariant)
    assert results[0] == results[1]
    assert all(torch.equal(a, b) for a, b in zip(*logits))


def test_greedy_tokens_are_transformers_generate_s(tiny_gemma3):
    """float32: past the window too (the long prompt is over three windows long), and the prefill's
    log-probabilities are transformers' forward's (close: transformers attends with its own SDPA)."""
    from tests.runtime.model.test_replica_generators import hf_greedy

    reference = AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()
    engine = engine_for(tiny_gemma3, num_blocks=64)
    assert engine.runner.decoder is not None and engine.runner.decoder.layers[0].window == WINDOW
    logits = recorded_logits(engine)
    prompts = [PROMPTS[0], LONG_PROMPT]
    served = run(engine, [request(str(i), p, max_tokens=10) for i, p in enumerate(prompts)])
    assert [served[str(i)]["choices"][0] for i in range(2)] == [hf_greedy(reference, p, 10) for p in prompts]
    with torch.no_grad():
        full = reference(torch.tensor([LONG_PROMPT])).logits[0, -1]
    assert torch.allclose(torch.log_softmax(logits[0][1], -1), torch.log_softmax(full, -1), atol=1e-5)


def test_bfloat16_greedy_tokens_are_transformers_choices(tiny_gemma3):
    """bfloat16: the tiny model's top logits lie within a few bfloat16 steps of each other, where
    transformers' own attention implementations disagree (its SDPA and eager `generate` pick other
    tokens on the long prompt). Each served token is transformers' forward's choice on the served
    sequence, or within two of its logit's bfloat16 steps of it; most are its choice exactly."""
    reference = AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.bfloat16).eval()
    engine = engine_for(tiny_gemma3, dtype="bfloat16", num_blocks=64)
    assert engine.runner.decoder is not None
    prompts = [PROMPTS[0], LONG_PROMPT]
    served = run(engine, [request(str(i), p, max_tokens=10) for i, p in enumerate(prompts)])
    exact = 0
    for i, prompt in enumerate(prompts):
        tokens = served[str(i)]["choices"][0]
        with torch.no_grad():
            steps = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
        for step, token in zip(steps, tokens):
            best = step.max()
            exact += int(step[token] == best)
            assert best - step[token] <= 2 * torch.finfo(torch.bfloat16).eps * best.abs()
    assert exact >= 18


def test_final_soft_capping_is_applied_as_transformers_does(tmp_path):
    """With `final_logit_softcapping` set, the lean logits are transformers' bits, and the capping is
    under test: every logit is within the cap, which the uncapped head's are not."""
    capped = write_gemma3(tmp_path / "capped", final_logit_softcapping=3.0)
    results, logits = lean_and_transformers(capped, "none", "float32")
    assert results[0] == results[1] and all(torch.equal(a, b) for a, b in zip(*logits))
    assert all(bool((step.abs() < 3.0).all()) for step in logits[0])
    engine = engine_for(write_gemma3(tmp_path / "uncapped"), num_blocks=64)
    uncapped = recorded_logits(engine)
    run(engine, [request("0", LONG_PROMPT, max_tokens=1)])
    assert float(uncapped[0].abs().max()) > 3.0


def test_attention_soft_capping_keeps_transformers_forward():
    """transformers' Gemma 3 keeps `attn_logit_softcapping` without applying it: ponder leaves such a
    config to transformers' forward rather than decide what it means."""
    with torch.device("meta"):
        model = Gemma3ForCausalLM(gemma3_config(attn_logit_softcapping=50.0))
    assert LeanDecoder.build(model) is None
    with torch.device("meta"):
        assert LeanDecoder.build(Gemma3ForCausalLM(gemma3_config())) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_offset_norm_gives_gemma3_rms_norm_s_bits(dtype):
    torch.manual_seed(0)
    module = Gemma3RMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.uniform_(-1, 1)
    norm = norm_of(module)
    assert isinstance(norm, OffsetRMSNorm)
    x = (torch.randn(7, 3, 48) * 30).to(dtype)
    assert torch.equal(norm(x), module(x)) and norm(x).dtype == dtype
