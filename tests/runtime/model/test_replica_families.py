"""The families ponder serves through transformers' forward, on replicas of their published checkpoints
(tests/replicas/families.py): greedy decoding gives transformers' `generate` tokens (float32) on a short
prompt and on one longer than any sliding window, and each family's own attention feature is under test
(the tokens differ without it)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.replicas.families import FAMILIES, SLIDING_WINDOW, write_family
from tests.runtime.engine_helpers import engine_for, run
from tests.runtime.engine_helpers import request as generate_request
from tests.runtime.model.test_replica_generators import hf_greedy, prompt_ids

MAX_TOKENS = 10
SHORT = [{"role": "user", "content": "Hi"}]
LONG = [{"role": "user", "content": "Tom has 5 apples and buys 3 more. Janet has 3 ducks and they lay 16 eggs. "
                                    "What is 2 + 3?"}]


# (Qwen3-MoE's and gpt-oss's experts run in ponder's kernels, row by row, under the default quantize:
# served with batch invariance, runtime.model.experts; refused under quantize = "none".)
# The families ponder's lean decoder runs (runtime.model.decoder); the others run transformers' forward.
LEAN_DECODER = ("qwen3_moe", "gemma3_text", "smollm3", "phi3", "gpt_oss")


@pytest.fixture(scope="module", params=FAMILIES)
def replica(request, tmp_path_factory):
    family = request.param
    directory = write_family(family, tmp_path_factory.mktemp(family))
    return family, directory, AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def served(directory, prompts, family=None, **options):
    """The greedy tokens the engine serves for `prompts`; with `family`, the engine is first held to
    the forward the family runs (the lean decoder's or transformers')."""
    engine = engine_for(directory, **options)
    if family is not None:
        assert (engine.runner.decoder is not None) == (family in LEAN_DECODER), family
    results = run(engine, [generate_request(str(i), p, max_tokens=MAX_TOKENS) for i, p in enumerate(prompts)])
    return [results[str(i)]["choices"][0] for i in range(len(prompts))]


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_greedy_decoding_matches_transformers_generate(replica, batch_invariant):
    family, directory, reference = replica
    short, long = prompt_ids(directory, SHORT), prompt_ids(directory, LONG)
    assert len(long) > SLIDING_WINDOW + MAX_TOKENS
    expected = [hf_greedy(reference, p, MAX_TOKENS) for p in (short, long)]
    assert served(directory, [short, long], family, batch_invariant=batch_invariant) == expected, \
        family


@pytest.mark.parametrize("family", ["gemma3_text", "phi3", "gpt_oss", "gemma4_text"])
def test_the_sliding_window_is_under_test(family, tmp_path):
    """Without the window, transformers gives other tokens on the long prompt: the test above holds
    ponder to the window."""
    directory = write_family(family, tmp_path / family)
    long = prompt_ids(directory, LONG)
    windowed = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    windowless = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, sliding_window=4096).eval()
    assert hf_greedy(windowed, long, MAX_TOKENS) != hf_greedy(windowless, long, MAX_TOKENS)


def test_gpt_oss_attention_sinks_are_under_test(tmp_path):
    """gpt-oss's sinks (one logit per head in the softmax's denominator) change its tokens: transformers
    without them (a sink of -inf weighs nothing) disagrees with the tokens ponder is held to above."""
    directory = write_family("gpt_oss", tmp_path / "gpt_oss")
    prompts = [prompt_ids(directory, SHORT), prompt_ids(directory, LONG)]
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    expected = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
    assert all(hf_greedy(model, p, MAX_TOKENS) != e for p, e in zip(prompts, expected))


def test_gemma4_layers_of_two_head_sizes_share_one_cache(tmp_path):
    """Gemma 4's global layers have a head twice the sliding layers' (and the last layers reuse earlier
    layers' keys): the cache holds the wider head, and the narrower layers' keys are padded into it."""
    from storage.kv_cache import kv_shape_of
    from transformers import AutoConfig

    directory = write_family("gemma4_text", tmp_path / "gemma4")
    shape = kv_shape_of(AutoConfig.from_pretrained(directory), block_size=4)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (4, 2, 32)


@pytest.mark.parametrize("family, paths", [
    # the lean decoder, its decode steps one call of the float stack kernel (routed experts and all),
    # every projection and expert in ponder's float kernel
    ("qwen3_moe", {"family": "qwen3_moe", "layers": "float_kernel", "linear": "float_kernel",
                   "attention": "cpu_kernel"}),
    # the lean decoder's Python loop (biased o projections and experts are not the stack kernel's), its
    # sinks applied by ponder's CPU decode kernel too
    ("gpt_oss", {"family": "gpt_oss", "layers": "lean", "linear": "float_kernel", "attention": "cpu_kernel"}),
    # the lean decoder, its decode steps one call of the float stack kernel (NoPE layers and all)
    ("smollm3", {"family": "smollm3", "layers": "float_kernel", "linear": "float_kernel",
                 "attention": "cpu_kernel"}),
    # the lean decoder's Python loop (Gemma's norms are not the stack kernel's), every projection in
    # ponder's float kernel (the family is named without transformers' `_text`)
    ("gemma3_text", {"family": "gemma3", "layers": "lean", "linear": "float_kernel",
                     "attention": "cpu_kernel"}),
])
def test_start_up_names_the_path_each_part_takes(family, paths, tmp_path, caplog):
    from runtime.bootstrap import engine_paths
    from runtime.model.paths import describe

    with caplog.at_level("INFO", logger="ponder.runtime"):
        engine = engine_for(write_family(family, tmp_path / family), batch_invariant=False)
    assert engine_paths(engine) == paths
    assert f"paths: {describe(paths)}" in caplog.messages
    assert describe(paths).startswith(f"family {paths['family']}: layers {paths['layers']}, linear float_kernel, "
                                      "attention ")


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_a_prompt_read_from_the_prefix_cache_gives_the_same_tokens(replica, batch_invariant):
    """Served twice, the long prompt's blocks come from the prefix cache the second time (its attention
    then reads them from the cache: windows, sinks and narrow heads included), with the same tokens."""
    family, directory, reference = replica
    long = prompt_ids(directory, LONG)
    engine = engine_for(directory, batch_invariant=batch_invariant)
    first = run(engine, [generate_request("a", long, max_tokens=MAX_TOKENS)])["a"]
    second = run(engine, [generate_request("b", long, max_tokens=MAX_TOKENS)])["b"]
    assert second["finished"].cached_tokens >= len(long) - 4, family  # whole blocks of 4 tokens
    assert first["choices"][0] == second["choices"][0] == hf_greedy(reference, long, MAX_TOKENS), family


def test_gemma3n_text_is_served_not_refused(tmp_path):
    """Gemma 3n's AltUp, laurel and per-layer inputs are stateless, and its last layers reuse earlier
    layers' keys: all its state across tokens is keys and values, so it is served (a tiny random
    gemma3n_text made by transformers, past its window of 6)."""
    from transformers import AutoConfig

    from tests.conftest import VOCAB, build_tokenizer

    config = AutoConfig.for_model(
        "gemma3n_text", vocab_size=len(VOCAB), vocab_size_per_layer_input=len(VOCAB), hidden_size=64,
        intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        hidden_size_per_layer_input=8, sliding_window=6, num_kv_shared_layers=2, laurel_rank=4,
        layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0])
    torch.manual_seed(0)
    directory = tmp_path / "gemma3n"
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    build_tokenizer(directory)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = list(range(3, 20))
    assert served(directory, [prompt]) == [hf_greedy(reference, prompt, MAX_TOKENS)]


@pytest.mark.parametrize("family, quantize", [("gpt_oss", "none"), ("qwen3_moe", "none")])
def test_batch_invariance_is_refused_for_routed_experts(family, quantize, tmp_path, caplog):
    """An expert's matmul runs over the tokens a step routes to it, a row count no padding controls (its
    bits change with it on a CPU): `batch_invariant = true` refuses to start, auto serves without it and
    says so (Qwen3-MoE's and gpt-oss's experts in torch's matmuls, `quantize = "none"`)."""
    from runtime.model.row_padding import InvarianceUnavailable

    directory = write_family(family, tmp_path / family)
    experts = {"gpt_oss": "GptOssExperts", "qwen3_moe": "Qwen3MoeExperts"}[family]
    with pytest.raises(InvarianceUnavailable, match=rf"^the routed experts \({experts}\) compute "
                                                     "each expert's tokens as one matmul"):
        engine_for(directory, batch_invariant=True, quantize=quantize)
    with caplog.at_level("WARNING", logger="ponder.runtime"):
        engine_for(directory, batch_invariant="auto", quantize=quantize)
    assert any(m.startswith(f"batch invariance is off: the routed experts ({experts})")
               for m in caplog.messages)


def test_a_convolution_is_not_taken_for_routed_experts():
    """A causal convolution's weight is three-dimensional too (the recurrent layers ponder will hold)."""
    from runtime.model.row_padding import routed_experts

    assert routed_experts(torch.nn.Sequential(torch.nn.Conv1d(8, 8, 4, groups=8), torch.nn.Linear(8, 8))) == []


@pytest.mark.parametrize("quantize", ["auto", "int4"])
def test_phi3_s_fused_projections_run_the_stack_kernel_to_the_loop_s_tokens(quantize, tmp_path):
    """Phi-3's qkv_proj and gate_up_proj are each one layer already: the lean decoder splits their
    outputs (queries, keys, values; gate, up) and its decode steps run as one stack-kernel call, to
    the very tokens and log-probabilities of its Python loop over the same kernels."""
    from runtime.bootstrap import engine_paths

    directory = write_family("phi3", tmp_path / "phi3")
    prompts = [prompt_ids(directory, SHORT), prompt_ids(directory, LONG)]
    results = []
    for stack in (True, False):
        engine = engine_for(directory, quantize=quantize, batch_invariant=True)
        assert engine_paths(engine)["layers"] == ("int_kernel" if quantize == "int4" else "float_kernel")
        if not stack:
            engine.runner.decoder.stack = None
        results.append(run(engine, [generate_request(str(i), p, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=2)
                                    for i, p in enumerate(prompts)]))
    assert results[0] == results[1]
