"""Replicas of published verifier checkpoints: `write_verifier(kind, directory)`, one per verifier kind
ponder offers (runtime/verify/verifiers).

Each writer states the published checkpoint it copies and where its layout was read: the model card's
own usage code, the inference code the authors point to, and vLLM's or transformers' classes for it.
Tensors are seeded random, saved with `safetensors.torch.save_file` under the published names.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.replicas import tokenizers as tk
from tests.replicas.generators import (
    HIDDEN,
    LLAMA3_TEMPLATE,
    NUM_HEADS,
    decoder_tensors,
    generator,
    lm_head,
    padded,
    qwen_template,
    save_weights,
    sizes,
    special_ids,
    write_json,
)

HEAD_DIM = HIDDEN // NUM_HEADS
QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\\\boxed{}."


def head(name: str, out_features: int, in_features: int = HIDDEN) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=generator(name)) / in_features ** 0.5


def bias(name: str, size: int) -> torch.Tensor:
    return 0.1 * torch.randn(size, generator=generator(name))


def body(kind: str, vocab: int, **options) -> dict[str, torch.Tensor]:
    # Unit final norm: the heads read hidden states of ordinary size, so scores spread over (0, 1).
    return decoder_tensors(kind, vocab_size=vocab, head_dim=HEAD_DIM, final_gain=1.0, **options)


def llama31_config(architecture: str, vocab: int, bos: int, eos, **extra) -> dict:
    """meta-llama/Llama-3.1-8B-Instruct's config.json fields (the base of RLHFlow's PRM and Skywork's
    reward model): llama3 rope scaling with factor 8, untied head."""
    return {"architectures": [architecture], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": bos, "eos_token_id": eos, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
            "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "use_cache": True, **sizes(vocab), **extra}


def write_qwen_prm(directory: Path) -> Path:
    """Qwen/Qwen2.5-Math-PRM-7B: `architectures: ["Qwen2ForProcessRewardModel"]` with an `auto_map` to
    its remote code (configuration_qwen2_rm.py / modeling_qwen2_rm.py, not shipped here), a Qwen2
    body under `model.*`, NO lm_head, and the head `score = Sequential(Linear(h, h), ReLU,
    Linear(h, 2))` saved as score.0.weight/bias [h, h]/[h] and score.2.weight/bias [2, h]/[2];
    `<extra_0>` in place of `<|quad_end|>`; 4 shards published (2 here).
    Sources: vllm-project/vllm vllm/model_executor/models/qwen2_rm.py (Qwen2RewardBaseModel.score,
    "adapted from huggingface.co/Qwen/Qwen2.5-Math-RM-72B/blob/main/modeling_qwen2_rm.py"); the model
    card huggingface.co/Qwen/Qwen2.5-Math-PRM-7B (README: make_step_rewards, `<extra_0>`), whose
    config.json fields are quoted in public notes (auto_map, bos 151643, eos 151645, tie false)."""
    spec = tk.TokenizerSpec(style="byte-level", tokenizer_class="Qwen2Tokenizer", bos=None, eos="<|im_end|>",
                            pad="<|endoftext|>", trailing=tk.QWEN_PRM_SPECIALS,
                            chat_template=qwen_template(QWEN_MATH_SYSTEM), model_max_length=131072,
                            extra_config={"errors": "replace", "split_special_tokens": False})
    tk.write_tokenizer(spec, directory)
    endoftext, im_end = special_ids(directory, "<|endoftext|>", "<|im_end|>")
    vocab = padded(len(tk.token_ids(directory)))
    config = {"architectures": ["Qwen2ForProcessRewardModel"], "attention_dropout": 0.0,
              "auto_map": {"AutoConfig": "configuration_qwen2_rm.Qwen2RMConfig",
                           "AutoModel": "modeling_qwen2_rm.Qwen2ForProcessRewardModel"},
              "bos_token_id": endoftext, "eos_token_id": im_end, "hidden_act": "silu",
              "initializer_range": 0.02, "max_position_embeddings": 4096, "max_window_layers": 28,
              "model_type": "qwen2", "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.37.0",
              "use_cache": True, "use_mrope": False, "use_sliding_window": False, **sizes(vocab)}
    write_json(directory, "config.json", config)
    tensors = body("qwen-prm", vocab, qkv_bias=True)
    tensors.update({"score.0.weight": head("qwen-prm/score.0", HIDDEN), "score.0.bias": bias("qwen-prm/b0", HIDDEN),
                    "score.2.weight": head("qwen-prm/score.2", 2), "score.2.bias": bias("qwen-prm/b2", 2)})
    save_weights(directory, tensors, torch.bfloat16, num_shards=2)
    return directory


def write_math_shepherd(directory: Path) -> Path:
    """peiyi9979/math-shepherd-mistral-7b-prm: a MistralForCausalLM (Mistral-7B-v0.1's config:
    sliding_window 4096, rope_theta 10000, untied lm_head, vocab 32000) with the Llama/Mistral
    SentencePiece tokenizer (BOS added, no chat template, no pad token). Step tag `ки` and the labels
    `+`/`-` are ordinary pieces (published ids 12902, 648, 387: "▁ки", "▁+", "▁-"). Sharded.
    Sources: the model card's usage (candidate_tokens = encode("+ -")[1:], step_tag_id =
    encode("ки")[-1]), as run by huggingface/search-and-learn src/sal/models/reward_models.py
    (CANDIDATE_TOKENS = [648, 387], STEP_TAG_ID = 12902, MathShepherd)."""
    spec = tk.TokenizerSpec(style="sentencepiece", tokenizer_class="LlamaTokenizer", bos="<s>", eos="</s>",
                            unk="<unk>", leading=tk.MISTRAL_V1_SPECIALS, add_bos=True,
                            model_max_length=1000000000000000019884624838656,
                            extra_config={"legacy": True, "spaces_between_special_tokens": False})
    tk.write_tokenizer(spec, directory)
    vocab = len(tk.token_ids(directory))
    config = {"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
              "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 32768,
              "model_type": "mistral", "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.34.0",
              "use_cache": True, **sizes(vocab)}
    write_json(directory, "config.json", config)
    tensors = body("math-shepherd", vocab)
    tensors["lm_head.weight"] = lm_head("math-shepherd", vocab)
    save_weights(directory, tensors, torch.bfloat16, num_shards=2)
    return directory


def write_rlhflow(directory: Path) -> Path:
    """RLHFlow/Llama3.1-8B-PRM-Deepseek-Data: Llama-3.1-8B-Instruct fine-tuned to answer each user
    turn (a step) with an assistant `+` or `-`; a LlamaForCausalLM with an untied lm_head and the
    Llama 3.1 chat template (system block with the knowledge/today dates). 4 shards published.
    Sources: RLHFlow/RLHF-Reward-Modeling math/README.md (the model list and card) and
    huggingface/search-and-learn src/sal/models/reward_models.py (RLHFFlow._score_single: the card's
    `logits[:, -3, candidate_tokens]`, candidate tokens encode("+")[-1], encode("-")[-1])."""
    spec = tk.TokenizerSpec(style="byte-level", tokenizer_class="PreTrainedTokenizerFast",
                            bos="<|begin_of_text|>", eos="<|eot_id|>", trailing=tk.LLAMA3_SPECIALS,
                            add_bos=True, chat_template=LLAMA3_TEMPLATE)
    tk.write_tokenizer(spec, directory)
    bos, end, eom, eot = special_ids(directory, "<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>",
                                     "<|eot_id|>")
    vocab = len(tk.token_ids(directory))
    write_json(directory, "config.json", llama31_config("LlamaForCausalLM", vocab, bos, [end, eom, eot],
                                                       transformers_version="4.44.0"))
    tensors = body("rlhflow", vocab)
    tensors["lm_head.weight"] = lm_head("rlhflow", vocab)
    save_weights(directory, tensors, torch.bfloat16, num_shards=2)
    return directory


def write_skywork(directory: Path) -> Path:
    """Skywork/Skywork-o1-Open-PRM-Qwen-2.5-1.5B: a Qwen2.5-Math-1.5B body (tied embeddings, so no
    lm_head tensor) whose safetensors also hold trl's value head `v_head.summary.weight` [1, h] and
    `v_head.summary.bias` [1]; `architectures: ["Qwen2ForPrmModel"]`, an architecture only Skywork's
    vLLM plugin knows (transformers builds the qwen2 model_type's class). The tokenizer has a
    bos_token, which the reference `prepare_input` prepends as text. One model.safetensors.
    Sources: huggingface/search-and-learn src/sal/models/skywork_o1_prm/prm_model.py (ValueHead
    `summary = Linear(hidden, 1)`, `v_head.` key prefix) and io_utils.py (prepare_input,
    derive_step_rewards), both from SkyworkAI/skywork-o1-prm-inference; tomalamb/skywork-o1-prm-inference
    README.md (vLLM plugin usage)."""
    spec = tk.TokenizerSpec(style="byte-level", tokenizer_class="Qwen2Tokenizer", bos="<|endoftext|>",
                            eos="<|endoftext|>", pad="<|endoftext|>", trailing=tk.QWEN2_SPECIALS,
                            chat_template=qwen_template(QWEN_MATH_SYSTEM), model_max_length=131072,
                            extra_config={"errors": "replace", "split_special_tokens": False})
    tk.write_tokenizer(spec, directory)
    (endoftext,) = special_ids(directory, "<|endoftext|>")
    vocab = padded(len(tk.token_ids(directory)))
    config = {"architectures": ["Qwen2ForPrmModel"], "attention_dropout": 0.0, "bos_token_id": endoftext,
              "eos_token_id": endoftext, "hidden_act": "silu", "initializer_range": 0.02,
              "max_position_embeddings": 4096, "max_window_layers": 21, "model_type": "qwen2",
              "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
              "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.44.2",
              "use_cache": True, "use_mrope": False, "use_sliding_window": False, **sizes(vocab)}
    write_json(directory, "config.json", config)
    tensors = body("skywork", vocab, qkv_bias=True)
    tensors.update({"v_head.summary.weight": head("skywork/v_head", 1),
                    "v_head.summary.bias": bias("skywork/v_head.bias", 1)})
    save_weights(directory, tensors, torch.bfloat16, num_shards=1)
    return directory


def write_orm(directory: Path) -> Path:
    """Skywork/Skywork-Reward-Llama-3.1-8B-v0.2: LlamaForSequenceClassification with one label
    (`score.weight` [1, h], no bias, no lm_head), a `[PAD]` token added after Llama 3.1's
    vocabulary and named as the config's pad_token_id (the classifier pools at the last non-pad
    token), the Llama 3.1 chat template. 4 shards published.
    Sources: huggingface/transformers src/transformers/models/llama/modeling_llama.py
    (LlamaForSequenceClassification: `score = Linear(hidden, num_labels, bias=False)`, pooling at the
    last non-pad token) and the model card's usage (apply_chat_template, strip the duplicate BOS,
    `rm(**inputs).logits[0][0]`)."""
    spec = tk.TokenizerSpec(style="byte-level", tokenizer_class="PreTrainedTokenizerFast",
                            bos="<|begin_of_text|>", eos="<|eot_id|>", pad="[PAD]",
                            trailing=tk.LLAMA3_SPECIALS + ("[PAD]",), add_bos=True,
                            chat_template=LLAMA3_TEMPLATE)
    tk.write_tokenizer(spec, directory)
    bos, eot, pad = special_ids(directory, "<|begin_of_text|>", "<|eot_id|>", "[PAD]")
    vocab = len(tk.token_ids(directory))
    write_json(directory, "config.json", llama31_config(
        "LlamaForSequenceClassification", vocab, bos, eot, pad_token_id=pad, id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0}, transformers_version="4.44.2"))
    tensors = body("orm", vocab)
    tensors["score.weight"] = head("orm/score", 1)
    save_weights(directory, tensors, torch.bfloat16, num_shards=2)
    return directory


WRITERS = {"qwen-prm": write_qwen_prm, "math-shepherd": write_math_shepherd, "rlhflow": write_rlhflow,
           "skywork": write_skywork, "orm": write_orm}
VERIFIER_KINDS = tuple(WRITERS)


def write_verifier(kind: str, directory: Path) -> Path:
    """Write the replica of verifier `kind` (one of VERIFIER_KINDS) into `directory`; returns it."""
    if kind not in WRITERS:
        raise ValueError(f"unknown verifier kind {kind!r}; expected one of {', '.join(VERIFIER_KINDS)}")
    return WRITERS[kind](Path(directory))
