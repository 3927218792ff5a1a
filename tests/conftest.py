"""Tiny random models, built and saved at test time so the real loading code is exercised."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# The GPU path's Triton kernels (runtime/kernels/gpu) run on a machine without CUDA in Triton's
# interpreter. Triton reads `TRITON_INTERPRET` when a kernel is decorated, so it is set here, before any
# test module imports them (tests/bench imports bench.gpu before tests/runtime/gpu_path is collected).
# Only Triton reads it; where CUDA is available it stays unset and tests/runtime/gpu_path is left out.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

VOCAB = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(60)] + [
    "+", "-", "ки", "Yes", "No", "<extra_0>", "\n", "\n\n", " ", ".", "0", "1", "2", "3"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def build_tokenizer(directory: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def build_model(directory: Path, arch: str = "llama", seed: int = 0, layers: int = 2):
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, SmolLM3Config, SmolLM3ForCausalLM)

    torch.manual_seed(seed)
    common = dict(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "qwen3":  # head_dim not hidden / heads, as Qwen3's published checkpoints
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32))
    elif arch == "smollm3":  # the second layer without rotary (NoPE), as every fourth in SmolLM3-3B
        model = SmolLM3ForCausalLM(SmolLM3Config(**common, no_rope_layers=[1, 0][:layers] + [1] * (layers - 2)))
    else:
        raise ValueError(arch)
    # Random init gives near-uniform logits; sharpen them so greedy decoding has clear winners.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(directory, safe_serialization=True)
    build_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    """A Qwen3 whose q and k norms are not all ones (random init leaves them so, which would hide them)."""
    import torch
    from transformers import AutoModelForCausalLM

    directory = build_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", seed=2)
    model = AutoModelForCausalLM.from_pretrained(directory)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.5 * torch.rand(norm.weight.shape, generator=gen))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="session")
def tiny_smollm3(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("tiny-smollm3"), "smollm3", seed=3)


