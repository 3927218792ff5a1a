"""Tokenizer files for the replicas: a tiny BPE vocabulary learned with the `tokenizers` library, laid
out like the published tokenizer it stands for.

Two styles, as published:
- byte-level BPE (Llama 3, Qwen): specials follow the learned vocabulary, in their published order
  and with their published gaps, e.g. Llama 3's `<|begin_of_text|>` at 128000 becomes id `base + 0`,
  `<|eot_id|>` (128009) becomes `base + 9`;
- SentencePiece-style BPE with byte fallback (Mistral, Gemma): the leading specials keep their
  published ids exactly (`<unk>` 0, `<s>` 1, `</s>` 2, `[INST]` 3, Gemma's `<start_of_turn>` 106...),
  then the 256 `<0xNN>` byte pieces, then the learned pieces.

`tokenizer.json`, `tokenizer_config.json` (with the chat template, as the published repos ship it)
and `special_tokens_map.json` are written by hand, not by a transformers class's save_pretrained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Text that makes the merges the verifiers rely on: " ки", " +", " -", "+", "-", "\n\n", digits.
CORPUS = [
    "Janet has 3 ducks and they lay 16 eggs ки\nShe eats 4 eggs ки\nThe answer is 12 ки",
    "Step 1: add 5 and 7 to get 12 + - ки\n\nStep 2: so the result is \\boxed{12} + -",
    "What is 2 + 3? The answer is 5. What is 9 - 4? The answer is 5.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "You are a helpful assistant. Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024",
    "system user assistant model The final answer is 68. Tom has 5 apples and buys 3 more.",
] * 8


@dataclass(frozen=True)
class TokenizerSpec:
    style: str  # "byte-level" or "sentencepiece"
    tokenizer_class: str  # as the published tokenizer_config.json names it
    bos: str | None
    eos: str
    pad: str | None = None
    unk: str | None = None
    leading: tuple[str, ...] = ()  # specials at the published low ids 0, 1, 2, ...
    trailing: tuple[str, ...] = ()  # specials after the learned vocabulary, in published order
    add_bos: bool = False  # the post-processor puts BOS before every encoded text
    add_prefix_space: bool = True  # sentencepiece style: a "▁" before the first word
    chat_template: str | None = None
    num_learned: int = 160  # learned pieces beyond the base alphabet
    model_max_length: int = 131072
    extra_config: dict[str, Any] = field(default_factory=dict)


def byte_pieces() -> list[str]:
    return [f"<0x{b:02X}>" for b in range(256)]


def learn(spec: TokenizerSpec) -> tuple[list[str], list[tuple[str, str]]]:
    """The learned pieces (alphabet first, then merges' results, in id order) and the merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if spec.style == "byte-level":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if spec.add_prefix_space else "never")
        alphabet = []
    base = len(alphabet) if alphabet else 64
    trainer = trainers.BpeTrainer(vocab_size=base + spec.num_learned, show_progress=False,
                                  initial_alphabet=alphabet)
    # SentencePiece vocabularies hold no newline piece: "\n" falls back to the byte <0x0A>.
    corpus = CORPUS if spec.style == "byte-level" else [t.replace("\n", " ") for t in CORPUS]
    tok.train_from_iterator(corpus, trainer)
    model = json.loads(tok.to_str())["model"]
    pieces = [piece for piece, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return pieces, merges


def build(spec: TokenizerSpec):
    """A `tokenizers.Tokenizer` with the spec's vocabulary layout, normalisation and BOS handling."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    learned, merges = learn(spec)
    if spec.style == "byte-level":
        ordered = list(spec.leading) + learned
        tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(ordered)}, merges=merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        ordered = list(spec.leading) + byte_pieces() + [p for p in learned if p not in spec.leading]
        tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(ordered)}, merges=merges,
                                   unk_token=spec.unk, byte_fallback=True, fuse_unk=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if spec.add_prefix_space else "never", split=False)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if spec.add_prefix_space:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.leading])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.trailing])
    if spec.add_bos:
        bos_id = tok.token_to_id(spec.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos}:0 $A:0", pair=f"{spec.bos}:0 $A:0 {spec.bos}:1 $B:1",
            special_tokens=[(spec.bos, bos_id)])
    elif spec.style == "byte-level":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def write_tokenizer(spec: TokenizerSpec, directory: Path) -> None:
    tok = build(spec)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    specials = list(spec.leading) + list(spec.trailing)
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                       "rstrip": False, "single_word": False, "special": True}
             for t in specials}
    config: dict[str, Any] = {
        "added_tokens_decoder": added,
        "bos_token": spec.bos,
        "clean_up_tokenization_spaces": False,
        "eos_token": spec.eos,
        "model_max_length": spec.model_max_length,
        "pad_token": spec.pad,
        "tokenizer_class": spec.tokenizer_class,
    }
    if spec.style == "sentencepiece":
        config.update(add_bos_token=spec.add_bos, add_eos_token=False, unk_token=spec.unk)
    if spec.chat_template is not None:
        config["chat_template"] = spec.chat_template
    config.update(spec.extra_config)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    special_map = {name: value for name, value in (("bos_token", spec.bos), ("eos_token", spec.eos),
                                                   ("pad_token", spec.pad), ("unk_token", spec.unk))
                   if value is not None}
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))


def token_ids(directory: Path) -> dict[str, int]:
    """Every piece's id in a written tokenizer.json, added tokens included."""
    data = json.loads((directory / "tokenizer.json").read_text())
    ids = dict(data["model"]["vocab"])
    ids.update({t["content"]: t["id"] for t in data["added_tokens"]})
    return ids


# ---------------------------------------------------------------------------------------------
# Published special tokens, in id order

# meta-llama/Llama-3.2-1B-Instruct and Llama-3.1-8B-Instruct tokenizer.json: ids 128000-128010 (the
# 245 further <|reserved_special_token_N|> are left out).
LLAMA3_SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>",
    "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
)

# Qwen/Qwen2.5-*-Instruct tokenizer.json: ids 151643-151664. Qwen2.5-Math-PRM puts `<extra_0>` in
# place of `<|quad_end|>` (151651); Qwen3 adds <tool_response>...</think> up to 151668.
QWEN2_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)
QWEN_PRM_SPECIALS = tuple("<extra_0>" if t == "<|quad_end|>" else t for t in QWEN2_SPECIALS)
QWEN3_SPECIALS = QWEN2_SPECIALS + ("<tool_response>", "</tool_response>", "<think>", "</think>")

# mistralai/Mistral-7B-Instruct-v0.3 tokenizer.json: ids 0-9 (then [control_8]...[control_768] up
# to 770, left out here, then the byte pieces).
MISTRAL_V3_SPECIALS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
)
# Mistral-7B-v0.1's (Math-Shepherd's) tokenizer: ids 0-2, then the bytes at 3-258 as published.
MISTRAL_V1_SPECIALS = ("<unk>", "<s>", "</s>")

# google/gemma-2-2b-it tokenizer.json: <pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4, then <unusedN>
# pieces here as fillers (the published 5-105 are not all of that name), so that <start_of_turn> and
# <end_of_turn> keep their published ids 106 and 107.
GEMMA_SPECIALS = (("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
                  + tuple(f"<unused{i}>" for i in range(101)) + ("<start_of_turn>", "<end_of_turn>"))
