"""A tiny byte-level BPE tokenizer (Qwen/Llama-3 style, with real character offsets) and tiny random
models for each verifier family, saved with save_pretrained and loaded back the way the server will."""

from __future__ import annotations

from pathlib import Path

import pytest

SPECIAL_TOKENS = ["<|endoftext|>", "<s>", "<|im_start|>", "<|im_end|>", "<extra_0>"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Enough text that the merges under test exist: " ки", " +", " -", "Yes", " Yes", "No", " No".
CORPUS = [
    "Janet has 3 ducks and they lay 16 eggs ки\nShe eats 4 eggs + ки\nThe answer is 12 - ки",
    "Step 1: add 5 and 7 to get 12 + \n\nStep 2: so the result is \\boxed{12} - ",
    "Is step 2 correct? Answer with Yes or No only. Yes No Yes No",
    "Problem: what is 2 + 3?\n\nSolution so far:\n\nStep 1: 2 + 3 = 5",
] * 20

HIDDEN = 32


def build_tokenizer(with_chat_template: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    # BOS on `add_special_tokens=True`, like the Llama/Mistral tokenizers the PRMs ship with.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                      special_tokens=[("<s>", tok.token_to_id("<s>"))]),
    ])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    if with_chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def model_config(arch: str, vocab_size: int, **extra):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=0, pad_token_id=0, **extra)
    return (LlamaConfig if arch == "llama" else Qwen2Config)(**common)


def save(directory: Path, model, tokenizer) -> Path:
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def plain_tokenizer():
    """The same tokenizer without a chat template."""
    return build_tokenizer(with_chat_template=False)


@pytest.fixture(scope="session")
def causal_lm_dir(tmp_path_factory, tokenizer) -> Path:
    """A llama causal LM: Math-Shepherd, RLHFlow, judge and confidence all run on one."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return save(tmp_path_factory.mktemp("causal-lm"), LlamaForCausalLM(model_config("llama", len(tokenizer))),
                tokenizer)


@pytest.fixture(scope="session")
def qwen_prm_dir(tmp_path_factory, tokenizer) -> Path:
    import torch
    from transformers import Qwen2ForTokenClassification

    torch.manual_seed(1)
    model = Qwen2ForTokenClassification(model_config("qwen2", len(tokenizer), num_labels=2))
    return save(tmp_path_factory.mktemp("qwen-prm"), model, tokenizer)


@pytest.fixture(scope="session")
def skywork_dir(tmp_path_factory, tokenizer) -> Path:
    """A qwen2 causal LM plus a value head saved, Skywork style, as `v_head.summary.*` in a second
    safetensors file of the same directory."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(2)
    model = Qwen2ForCausalLM(model_config("qwen2", len(tokenizer)))
    directory = save(tmp_path_factory.mktemp("skywork"), model, tokenizer)
    save_file({"v_head.summary.weight": torch.randn(1, HIDDEN), "v_head.summary.bias": torch.randn(1)},
              str(directory / "value_head.safetensors"))
    return directory


@pytest.fixture(scope="session")
def orm_dir(tmp_path_factory, tokenizer) -> Path:
    import torch
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(3)
    model = LlamaForSequenceClassification(model_config("llama", len(tokenizer), num_labels=1))
    return save(tmp_path_factory.mktemp("orm"), model, tokenizer)


@pytest.fixture(scope="session")
def two_label_orm(tokenizer):
    import torch
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(5)
    return LlamaForSequenceClassification(model_config("llama", len(tokenizer), num_labels=2)).eval()
