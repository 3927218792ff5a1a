"""A tiny random Llama over the embedded model's byte-level BPE tokenizer (SmolLM2's, 49,152 tokens):
what constrained decoding needs (llguidance reads BPE tokenizers), at the size of the tests' models."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm_tokenizer():
    from runtime.model.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="session")
def bpe_llama(tmp_path_factory, smollm_tokenizer) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("bpe-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(smollm_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper than random: greedy has clear winners
    model.save_pretrained(directory, safe_serialization=True)
    smollm_tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def compiler(smollm_tokenizer):
    from runtime.grammar.compiler import GrammarCompiler

    compiler = GrammarCompiler(smollm_tokenizer, len(smollm_tokenizer), frozenset({2}), "hermes")
    yield compiler
    compiler.close()
