"""ponder's loader and engine on checkpoints laid out as the published generators are (tests/replicas):
every published tensor is used, and greedy decoding gives transformers' `generate` tokens."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from runtime.model import attention
from runtime.model.loader import load_causal_lm, load_tokenizer, resolve_model
from tests.replicas.generators import GEMMA2_SLIDING_WINDOW, GENERATOR_FAMILIES, write_generator
from tests.runtime.engine_helpers import engine_for, run
from tests.runtime.engine_helpers import request as generate_request

QUESTION = [{"role": "user", "content": "What is 2 + 3? Please reason step by step."}]
MAX_TOKENS = 10



def hf_greedy(model, prompt_ids, max_new_tokens):
    """transformers' greedy `generate` with the request's parameters only. Published generation
    configs carry sampling defaults (Qwen2.5-Instruct's repetition_penalty 1.1) that `generate` would
    apply and ponder does not read, so the penalty is named here, as the engine's request has it."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             repetition_penalty=1.0, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module", params=GENERATOR_FAMILIES)
def replica(request, tmp_path_factory):
    family = request.param
    return family, write_generator(family, tmp_path_factory.mktemp(family.replace(".", "_")))


@pytest.fixture(scope="module")
def reference(replica):
    return AutoModelForCausalLM.from_pretrained(replica[1], dtype=torch.float32).eval()


def published_tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def prompt_ids(directory, messages=QUESTION) -> list[int]:
    tokenizer = load_tokenizer(resolve_model(str(directory)))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_shards_and_their_index_agree(replica):
    _, directory = replica
    index_path = directory / "model.safetensors.index.json"
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not index_path.exists():
        assert files == ["model.safetensors"]
        return
    weight_map = json.loads(index_path.read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == files
    assert set(weight_map) == set(published_tensors(directory))


def test_ponder_loads_every_published_tensor(replica):
    family, directory = replica
    config = json.loads((directory / "config.json").read_text())
    model = load_causal_lm(resolve_model(str(directory)), torch.device("cpu"), torch.float32,
                           attention.register())
    state = model.state_dict()
    tensors = published_tensors(directory)
    for name, tensor in tensors.items():
        assert name in state, (family, name)
        assert torch.equal(state[name], tensor.float()), (family, name)
    if config.get("tie_word_embeddings", True):
        assert "lm_head.weight" not in tensors
        assert torch.equal(model.get_output_embeddings().weight, tensors["model.embed_tokens.weight"].float())
    # Nothing the model holds was left at its random initialisation.
    assert set(state) - set(tensors) <= {"lm_head.weight"}, set(state) - set(tensors)


def test_the_chat_template_renders_the_published_turn_markers(replica):
    family, directory = replica
    tokenizer = load_tokenizer(resolve_model(str(directory)))
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    expected = {
        "llama3": ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n",
                   "<|start_header_id|>assistant<|end_header_id|>\n\n"),
        "qwen2.5": ("<|im_start|>system\nYou are Qwen", "<|im_end|>\n<|im_start|>assistant\n"),
        "qwen3": ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"),
        "mistral": ("<s>[INST] ", "[/INST]"),
        "gemma2": ("<bos><start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n"),
    }[family]
    assert text.startswith(expected[0]) and text.endswith(expected[1]), text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == (tokenizer.bos_token_id is not None)


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_greedy_decoding_matches_transformers_generate(replica, reference, batch_invariant):
    family, directory = replica
    prompts = [prompt_ids(directory),
               prompt_ids(directory, [{"role": "user", "content": "Tom has 5 apples."}])]
    engine = engine_for(directory, batch_invariant=batch_invariant)
    results = run(engine, [generate_request(str(i), p, max_tokens=MAX_TOKENS) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        expected = hf_greedy(reference, prompt, MAX_TOKENS)
        assert len(expected) == MAX_TOKENS
        assert results[str(i)]["choices"][0] == expected, (family, prompt)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    directory = write_generator("gemma2", tmp_path_factory.mktemp("gemma2_window"))
    return directory, AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def gemma2_without(directory, **removed):
    """The replica as transformers runs it with some of Gemma 2's attention features switched off."""
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **removed).eval()


def within_window(directory, content):
    prompt = prompt_ids(directory, [{"role": "user", "content": content}])
    return prompt, GEMMA2_SLIDING_WINDOW - len(prompt)  # every position stays inside the window


def test_gemma2_greedy_decoding_where_capping_changes_no_token(gemma2):
    """Sandwich norms, (1 + w) norms, scaled embeddings, gelu-tanh and query_pre_attn_scalar, on a
    prompt whose tokens soft-capping happens not to change, every position inside the window."""
    directory, reference = gemma2
    prompt, max_tokens = within_window(directory, "2 + 3?")
    expected = hf_greedy(reference, prompt, max_tokens)
    assert hf_greedy(gemma2_without(directory, attn_logit_softcapping=None), prompt, max_tokens) == expected
    results = run(engine_for(directory), [generate_request("r", prompt, max_tokens=max_tokens)])
    assert results["r"]["choices"][0] == expected


def test_gemma2_attention_softcapping(gemma2):
    """Attention scores pass through 50 * tanh(score / 50) before the softmax; every position is
    inside the window, so only the capping is under test."""
    directory, reference = gemma2
    prompt, max_tokens = within_window(directory, "Hi")
    expected = hf_greedy(reference, prompt, max_tokens)
    assert hf_greedy(gemma2_without(directory, attn_logit_softcapping=None), prompt, max_tokens) != expected
    results = run(engine_for(directory), [generate_request("r", prompt, max_tokens=max_tokens)])
    assert results["r"]["choices"][0] == expected


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_gemma2_sliding_window(gemma2, batch_invariant):
    """Gemma 2's even layers attend to the last `sliding_window` positions only: in the prompt's
    prefill (exact or SDPA's place) and in decoding. Against the very same model without the window,
    the tokens differ, so the window is under test."""
    directory, reference = gemma2
    prompt = prompt_ids(directory, [{"role": "user", "content": "Tom has 5 apples and buys 3 more. "
                                                                "Janet has 3 ducks and they lay 16 eggs."}])
    assert len(prompt) > GEMMA2_SLIDING_WINDOW
    expected = hf_greedy(reference, prompt, MAX_TOKENS)
    windowless = gemma2_without(directory, sliding_window=4096)
    assert hf_greedy(windowless, prompt, MAX_TOKENS) != expected
    results = run(engine_for(directory, batch_invariant=batch_invariant),
                  [generate_request("r", prompt, max_tokens=MAX_TOKENS)])
    assert results["r"]["choices"][0] == expected


@pytest.mark.parametrize("quantize", ["none", "auto", "int4"])
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_mistral_runs_in_the_lean_decoder_within_its_sliding_window(tmp_path, quantize, batch_invariant):
    """Mistral (llama's layers, its config's sliding window on every layer, as Mistral-7B-v0.1 and the
    math-shepherd reward model publish it) in the lean decoder: with a window shorter than the prompt,
    transformers' greedy tokens (`quantize = none`), which the same model without the window does not
    give; in the kernels (`auto`, `int4`, their own roundings) tokens other than the same engine's
    without the window."""
    directory = write_generator("mistral", tmp_path / "mistral")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "sliding_window": 12}))
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = prompt_ids(directory, [{"role": "user", "content": "Tom has 5 apples and buys 3 more. "
                                                                "Janet has 3 ducks and they lay 16 eggs."}])
    assert len(prompt) > 12 + MAX_TOKENS
    engine = engine_for(directory, quantize=quantize, batch_invariant=batch_invariant)
    decoder = engine.runner.decoder
    assert decoder is not None and {layer.window for layer in decoder.layers} == {12}
    results = run(engine, [generate_request("r", prompt, max_tokens=MAX_TOKENS)])
    if quantize == "none":
        expected = hf_greedy(reference, prompt, MAX_TOKENS)
        windowless = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, sliding_window=None).eval()
        assert hf_greedy(windowless, prompt, MAX_TOKENS) != expected
        assert results["r"]["choices"][0] == expected
    else:  # the window reaches the kernels' paths too (the stack kernel's and the loop's)
        (tmp_path / "windowless").mkdir()
        for path in directory.iterdir():
            (tmp_path / "windowless" / path.name).write_bytes(path.read_bytes())
        (tmp_path / "windowless" / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
        unwindowed = run(engine_for(tmp_path / "windowless", quantize=quantize, batch_invariant=batch_invariant),
                         [generate_request("r", prompt, max_tokens=MAX_TOKENS)])
        assert len(results["r"]["choices"][0]) == MAX_TOKENS
        assert results["r"]["choices"][0] != unwindowed["r"]["choices"][0]
