"""Replicas of hybrid checkpoints, whose linear-attention layers keep a recurrent state: `write_qwen35`
(Qwen3.5 dense and MoE) and `write_qwen3_next`.

As tests/replicas/generators.py: seeded random tensors under the published names, saved with
safetensors. The tensor names and shapes are listed from transformers' own module tree on the meta
device (nothing is computed there) and written under the published prefix.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.replicas import tokenizers as tk
from tests.replicas.generators import (EMBED_STD, HIDDEN, SHARPEN, generator, padded, qwen_template,
                                       qwen_tokenizer, save_weights, special_ids, write_json)

QWEN35_LAYERS = 4  # three Gated DeltaNet layers, then one full-attention layer (published interval 4)


def qwen35_text_config(vocab: int, eos: int, bos: int, moe: bool = False) -> dict:
    """Qwen/Qwen3.5-0.8B's `text_config`, shrunk: published hidden 1024, 24 layers (18 linear, 6 full),
    16 linear key heads and 16 value heads of 128, kernel 4, 8 query and 2 KV heads of 256 for full
    attention, a gated attention output, partial rotary 0.25 with interleaved mrope sections.
    Sources: huggingface/transformers src/transformers/models/qwen3_5/configuration_qwen3_5.py and
    modeling_qwen3_5.py (Qwen3_5GatedDeltaNet, Qwen3_5Attention)."""
    config = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text", "hidden_size": HIDDEN,
        "intermediate_size": 128, "num_hidden_layers": QWEN35_LAYERS, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144, "vocab_size": vocab, "tie_word_embeddings": True,
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "full_attention_interval": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "eos_token_id": eos, "bos_token_id": bos,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True, "mrope_section": [2, 1, 1]},
        "dtype": "bfloat16",
    }
    if moe:  # Qwen/Qwen3.5-35B-A3B: 256 experts, 8 routed + 1 shared; here 4 experts, 2 routed
        config.update({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                       "shared_expert_intermediate_size": 32, "router_aux_loss_coef": 0.001})
    return config


def _meta_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    text = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _tensor(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if name.endswith("embed_tokens.weight"):
        return EMBED_STD * torch.randn(shape, generator=g)
    if name.endswith("A_log"):  # decays exp(-exp(A_log) * softplus(.)) well inside (0, 1)
        return torch.empty(shape).uniform_(-1.0, 1.0, generator=g)
    if name.endswith("dt_bias"):
        return 0.5 * torch.randn(shape, generator=g)
    if name.endswith("linear_attn.norm.weight"):  # the gated RMSNorm multiplies by its weight
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name == "model.norm.weight":  # (1 + w) norms: the final one sharpened as the other replicas'
        return SHARPEN - 1.0 + 0.1 * torch.randn(shape, generator=g)
    if "norm" in name:  # Qwen3_5RMSNorm multiplies by (1 + weight): published weights lie around 0
        return 0.1 * torch.randn(shape, generator=g)
    if name.endswith("conv1d.weight"):
        return torch.randn(shape, generator=g) / shape[-1] ** 0.5
    return torch.randn(shape, generator=g) / shape[-1] ** 0.5


def write_qwen35(directory: Path, moe: bool = False) -> Path:
    """Qwen/Qwen3.5-0.8B (or, with `moe`, Qwen3.5-35B-A3B) as published: `Qwen3_5ForConditionalGeneration`
    with a `text_config`, the text model's tensors under `model.language_model.` (the vision tower's
    are left out: ponder serves text), tied embeddings, `<think>` in the chat template."""
    directory = Path(directory)
    spec = qwen_tokenizer(tk.QWEN3_SPECIALS, qwen_template(None, thinking=True))
    tk.write_tokenizer(spec, directory)
    endoftext, im_end = special_ids(directory, "<|endoftext|>", "<|im_end|>")
    vocab = padded(len(tk.token_ids(directory)))
    text = qwen35_text_config(vocab, im_end, endoftext, moe)
    name = "qwen3_5_moe" if moe else "qwen3_5"
    architecture = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    config = {"architectures": [architecture], "model_type": name, "text_config": text,
              "tie_word_embeddings": True, "image_token_id": 248056, "video_token_id": 248057,
              "vision_start_token_id": 248053, "vision_end_token_id": 248054,
              "vision_config": {"model_type": f"{name}_vision", "depth": 1, "hidden_size": 32, "num_heads": 2,
                                "intermediate_size": 64, "out_hidden_size": HIDDEN}}
    write_json(directory, "config.json", config)
    write_json(directory, "generation_config.json", {
        "bos_token_id": endoftext, "pad_token_id": endoftext, "do_sample": True,
        "eos_token_id": [im_end, endoftext], "temperature": 0.6, "top_k": 20, "top_p": 0.95})
    g = generator(name)
    tensors = {}
    for key, shape in sorted(_meta_shapes(text).items()):
        if key == "lm_head.weight":
            continue  # tied
        tensors[key.replace("model.", "model.language_model.", 1)] = _tensor(key, shape, g)
    save_weights(directory, tensors, torch.float32, num_shards=1)
    return directory


def write_qwen3_next(directory: Path) -> Path:
    """Qwen/Qwen3-Next-80B-A3B-Instruct, shrunk: `Qwen3NextForCausalLM`, Gated DeltaNet layers whose q, k, v, z
    come from one projection grouped by key head (`in_proj_qkvz`, `in_proj_ba`), every fourth layer full
    attention with a gated output, routed experts (published 512, 10 routed) with a shared expert, untied.
    Sources: huggingface/transformers src/transformers/models/qwen3_next/configuration_qwen3_next.py and
    modeling_qwen3_next.py."""
    directory = Path(directory)
    spec = qwen_tokenizer(tk.QWEN3_SPECIALS, qwen_template(None, thinking=True))
    tk.write_tokenizer(spec, directory)
    endoftext, im_end = special_ids(directory, "<|endoftext|>", "<|im_end|>")
    vocab = padded(len(tk.token_ids(directory)))
    config = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": HIDDEN,
              "intermediate_size": 128, "num_hidden_layers": QWEN35_LAYERS, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6,
              "max_position_embeddings": 262144, "vocab_size": vocab, "tie_word_embeddings": False,
              "attention_bias": False, "attention_dropout": 0.0, "full_attention_interval": 4,
              "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
              "linear_num_key_heads": 2, "linear_num_value_heads": 4, "decoder_sparse_step": 1,
              "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [],
              "partial_rotary_factor": 0.25, "rope_theta": 10000000, "eos_token_id": im_end,
              "bos_token_id": endoftext, "torch_dtype": "bfloat16"}
    write_json(directory, "config.json", config)
    write_json(directory, "generation_config.json", {"bos_token_id": endoftext, "pad_token_id": endoftext,
                                                     "eos_token_id": [im_end, endoftext], "do_sample": True,
                                                     "temperature": 0.7, "top_k": 20, "top_p": 0.8})
    g = generator("qwen3_next")
    tensors = {key: _tensor(key, shape, g) for key, shape in sorted(_meta_shapes(config).items())}
    save_weights(directory, tensors, torch.float32, num_shards=1)
    return directory
