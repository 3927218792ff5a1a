"""Replicas of the published checkpoints of the families ponder runs through transformers' forward:
`write_family(family, directory)`, as tests/replicas/generators.py writes the anchor families.

Each writer says which published checkpoint it copies; its config keeps the published fields with
the sizes shrunk (and any sliding window shrunk below a test prompt's length), its tensors carry the
published names, and the tokenizer is one of generators.py's (the vocabulary is not under test here).
Weights are float32, seeded, never written by a transformers model class.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.replicas import generators as g
from tests.replicas import tokenizers as tk

SLIDING_WINDOW = 24  # every family's window, shrunk from the published one so a test prompt outgrows it
NUM_EXPERTS = 4
EXPERTS_PER_TOKEN = 2
MOE_INTERMEDIATE = 32


def _qwen3_tokenizer(directory: Path) -> tuple[int, int, int]:
    tk.write_tokenizer(g.qwen_tokenizer(tk.QWEN3_SPECIALS, g.qwen_template(None, thinking=True)), directory)
    endoftext, im_end = g.special_ids(directory, "<|endoftext|>", "<|im_end|>")
    return endoftext, im_end, g.padded(len(tk.token_ids(directory)))


def _gemma_tokenizer(directory: Path) -> int:
    spec = tk.TokenizerSpec(style="sentencepiece", tokenizer_class="GemmaTokenizer", bos="<bos>", eos="<eos>",
                            pad="<pad>", unk="<unk>", leading=tk.GEMMA_SPECIALS, add_bos=True,
                            add_prefix_space=False, chat_template=g.GEMMA_TEMPLATE,
                            extra_config={"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tk.write_tokenizer(spec, directory)
    return len(tk.token_ids(directory))


def _llama3_tokenizer(directory: Path) -> int:
    tk.write_tokenizer(g.LLAMA3_TOKENIZER, directory)
    return len(tk.token_ids(directory))


def _linear(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5


def _experts(gen: torch.Generator, prefix: str) -> dict[str, torch.Tensor]:
    """Routed experts as Qwen3-MoE's checkpoints name them: a router `gate` and one MLP per expert."""
    tensors = {prefix + "gate.weight": _linear(gen, NUM_EXPERTS, g.HIDDEN)}
    for e in range(NUM_EXPERTS):
        p = f"{prefix}experts.{e}."
        tensors[p + "gate_proj.weight"] = _linear(gen, MOE_INTERMEDIATE, g.HIDDEN)
        tensors[p + "up_proj.weight"] = _linear(gen, MOE_INTERMEDIATE, g.HIDDEN)
        tensors[p + "down_proj.weight"] = _linear(gen, g.HIDDEN, MOE_INTERMEDIATE)
    return tensors


def write_qwen3_moe(directory: Path) -> Path:
    """Qwen/Qwen3-30B-A3B: every layer's MLP routed over experts (`mlp.gate`, `mlp.experts.N.*`; 128
    experts, 8 a token, published; 4 and 2 here), normalised top-k weights, q/k norms, untied head.
    Sources: transformers models/qwen3_moe/configuration_qwen3_moe.py and modeling_qwen3_moe.py."""
    endoftext, im_end, vocab = _qwen3_tokenizer(directory)
    head_dim = 2 * g.HIDDEN // g.NUM_HEADS
    config = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": endoftext, "decoder_sparse_step": 1, "eos_token_id": im_end, "hidden_act": "silu",
              "initializer_range": 0.02, "max_position_embeddings": 40960, "max_window_layers": 48,
              "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": MOE_INTERMEDIATE,
              "norm_topk_prob": True, "num_experts": NUM_EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN,
              "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
              "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
              "torch_dtype": "float32", "transformers_version": "4.51.0", "use_cache": True,
              "use_sliding_window": False, **g.sizes(vocab, head_dim=head_dim)}
    g.write_json(directory, "config.json", config)
    tensors = g.decoder_tensors("qwen3_moe", vocab_size=vocab, head_dim=head_dim, qk_norm=True)
    gen = g.generator("qwen3_moe/experts")
    for i in range(g.NUM_LAYERS):
        p = f"model.layers.{i}.mlp."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del tensors[p + name + ".weight"]
        tensors.update(_experts(gen, p))
    tensors["lm_head.weight"] = g.lm_head("qwen3_moe", vocab)
    g.save_weights(directory, tensors, torch.float32, num_shards=1)
    return directory


def write_gemma3_text(directory: Path) -> Path:
    """google/gemma-3-1b-it: Gemma 2's sandwich norms, (1 + w) norms, scaled embeddings and
    query_pre_attn_scalar, with q/k norms instead of soft-capping, sliding layers (published window 512,
    5 of every 6 layers; here `SLIDING_WINDOW`, 1 of 2) with their own rope base (rope_local_base_freq).
    Sources: transformers models/gemma3/configuration_gemma3.py (Gemma3TextConfig), modeling_gemma3.py."""
    vocab = _gemma_tokenizer(directory)
    head_dim = 2 * g.HIDDEN // g.NUM_HEADS
    config = {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
              "eos_token_id": [1, 106], "final_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh",
              "initializer_range": 0.02, "max_position_embeddings": 32768, "model_type": "gemma3_text",
              "pad_token_id": 0, "query_pre_attn_scalar": head_dim, "rms_norm_eps": 1e-06,
              "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
              "sliding_window": SLIDING_WINDOW, "sliding_window_pattern": 2,
              "layer_types": ["sliding_attention", "full_attention"], "torch_dtype": "float32",
              "transformers_version": "4.50.0.dev0", "use_cache": True, **g.sizes(vocab, head_dim=head_dim)}
    g.write_json(directory, "config.json", config)
    tensors = g.decoder_tensors("gemma3", vocab_size=vocab, head_dim=head_dim, qk_norm=True, sandwich_norms=True,
                                norm_offset=0.0)
    for i in range(g.NUM_LAYERS):  # the layers' outputs, not the (tied, scaled) input embedding, steer the next token
        for norm in ("post_attention_layernorm", "post_feedforward_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] += 3.0
    g.save_weights(directory, tensors, torch.float32, num_shards=1)
    return directory


def write_phi3(directory: Path) -> Path:
    """microsoft/Phi-3-mini-4k-instruct: q, k and v in one `qkv_proj`, gate and up in one `gate_up_proj`,
    a sliding window on every layer (published 2047; here `SLIDING_WINDOW`), untied head.
    Sources: transformers models/phi3/configuration_phi3.py and modeling_phi3.py."""
    vocab = _llama3_tokenizer(directory)
    head_dim = g.HIDDEN // g.NUM_HEADS
    config = {"architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": None, "embd_pdrop": 0.0, "eos_token_id": None, "hidden_act": "silu",
              "initializer_range": 0.02, "max_position_embeddings": 4096, "model_type": "phi3",
              "original_max_position_embeddings": 4096, "pad_token_id": None, "resid_pdrop": 0.0,
              "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": SLIDING_WINDOW,
              "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.40.2",
              "use_cache": True, **g.sizes(vocab)}
    g.write_json(directory, "config.json", config)
    tensors = g.decoder_tensors("phi3", vocab_size=vocab, head_dim=head_dim)
    for i in range(g.NUM_LAYERS):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [tensors.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        tensors[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [tensors.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
    tensors["lm_head.weight"] = g.lm_head("phi3", vocab)
    g.save_weights(directory, tensors, torch.float32, num_shards=1)
    return directory


def write_smollm3(directory: Path) -> Path:
    """HuggingFaceTB/SmolLM3-3B: llama layers where every fourth skips rotary embeddings (NoPE,
    `no_rope_layers`, 1 = rope; here the second of two layers skips it), tied embeddings.
    Sources: transformers models/smollm3/configuration_smollm3.py and modeling_smollm3.py."""
    vocab = _llama3_tokenizer(directory)
    config = {"architectures": ["SmolLM3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": None, "eos_token_id": None, "hidden_act": "silu", "initializer_range": 0.02,
              "max_position_embeddings": 65536, "max_window_layers": 28, "mlp_bias": False, "model_type": "smollm3",
              "no_rope_layer_interval": 4, "no_rope_layers": [1, 0], "pad_token_id": None, "pretraining_tp": 2,
              "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 5000000.0, "sliding_window": None,
              "tie_word_embeddings": True, "torch_dtype": "float32", "transformers_version": "4.53.0.dev0",
              "use_cache": False, "use_sliding_window": False, **g.sizes(vocab)}
    g.write_json(directory, "config.json", config)
    g.save_weights(directory, g.decoder_tensors("smollm3", vocab_size=vocab, head_dim=g.HIDDEN // g.NUM_HEADS),
                   torch.float32, num_shards=1)
    return directory


def write_gpt_oss(directory: Path) -> Path:
    """openai/gpt-oss-20b (as its bfloat16 conversions publish it, the MXFP4 experts dequantized):
    attention sinks (a learned logit per head in the softmax's denominator, `self_attn.sinks`), biases
    on every projection, sliding and full layers alternating (published window 128; here
    `SLIDING_WINDOW`), experts stored fused (`experts.gate_up_proj` [E, hidden, 2I] with gate and up
    interleaved, `experts.down_proj` [E, I, hidden], each with a bias) behind a router with a bias,
    clamped swiglu, yarn rope, untied head. Sources: transformers models/gpt_oss/configuration_gpt_oss.py
    and modeling_gpt_oss.py."""
    vocab = _llama3_tokenizer(directory)
    head_dim = g.HIDDEN // g.NUM_HEADS
    config = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
              "eos_token_id": None, "experts_per_token": EXPERTS_PER_TOKEN, "head_dim": head_dim,
              "hidden_act": "silu", "initial_context_length": 4096, "initializer_range": 0.02,
              "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 131072,
              "model_type": "gpt_oss", "num_experts_per_tok": EXPERTS_PER_TOKEN, "num_local_experts": NUM_EXPERTS,
              "output_router_logits": False, "pad_token_id": None, "rms_norm_eps": 1e-05,
              "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                               "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
              "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": SLIDING_WINDOW,
              "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "float32",
              "transformers_version": "4.55.0.dev0", "use_cache": True,
              **g.sizes(vocab, intermediate_size=MOE_INTERMEDIATE)}
    g.write_json(directory, "config.json", config)
    gen = g.generator("gpt_oss")
    tensors = g.decoder_tensors("gpt_oss", vocab_size=vocab, head_dim=head_dim, qkv_bias=True, query_gain=4.0)
    for i in range(g.NUM_LAYERS):
        p = f"model.layers.{i}."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del tensors[p + f"mlp.{name}.weight"]
        tensors[p + "self_attn.o_proj.bias"] = 0.1 * torch.randn(g.HIDDEN, generator=gen)
        tensors[p + "self_attn.sinks"] = 1.0 + 2.0 * torch.randn(g.NUM_HEADS, generator=gen)
        tensors[p + "mlp.router.weight"] = _linear(gen, NUM_EXPERTS, g.HIDDEN)
        tensors[p + "mlp.router.bias"] = 0.1 * torch.randn(NUM_EXPERTS, generator=gen)
        tensors[p + "mlp.experts.gate_up_proj"] = _linear(gen, NUM_EXPERTS, 2 * MOE_INTERMEDIATE, g.HIDDEN) \
            .transpose(1, 2).contiguous()
        tensors[p + "mlp.experts.gate_up_proj_bias"] = 0.1 * torch.randn(NUM_EXPERTS, 2 * MOE_INTERMEDIATE,
                                                                         generator=gen)
        tensors[p + "mlp.experts.down_proj"] = _linear(gen, NUM_EXPERTS, g.HIDDEN, MOE_INTERMEDIATE) \
            .transpose(1, 2).contiguous()
        tensors[p + "mlp.experts.down_proj_bias"] = 0.1 * torch.randn(NUM_EXPERTS, g.HIDDEN, generator=gen)
    tensors["lm_head.weight"] = g.lm_head("gpt_oss", vocab)
    g.save_weights(directory, tensors, torch.float32, num_shards=1)
    return directory


GEMMA4_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
GEMMA4_PER_LAYER = 8  # hidden_size_per_layer_input, published 256


def write_gemma4_text(directory: Path) -> Path:
    """google/gemma-4-E2B-it's text model (the defaults transformers' Gemma4TextConfig documents for it):
    global layers with a head twice the sliding layers' (`global_head_dim` 512 beside `head_dim` 256;
    here 32 and 16) and their own rope (proportional, a quarter of the head rotated), sliding layers
    (published window 512; here `SLIDING_WINDOW`), the last layers reusing earlier layers' keys and
    values (`num_kv_shared_layers`, published 20 of 35; here 2 of 4, which hold no k/v projections),
    per-layer input embeddings (`embed_tokens_per_layer`), q/k norms and an unscaled v norm, a learned
    `layer_scalar`, sandwich norms, final-logit soft-capping, tied embeddings.
    Sources: transformers models/gemma4/configuration_gemma4.py (Gemma4TextConfig) and modeling_gemma4.py."""
    vocab = _gemma_tokenizer(directory)
    head_dim, global_head_dim, per_layer = g.HIDDEN // g.NUM_HEADS, 2 * g.HIDDEN // g.NUM_HEADS, GEMMA4_PER_LAYER
    layers = len(GEMMA4_LAYER_TYPES)
    config = {"architectures": ["Gemma4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "attention_k_eq_v": False, "bos_token_id": 2, "enable_moe_block": False, "eos_token_id": [1, 106],
              "final_logit_softcapping": 30.0, "global_head_dim": global_head_dim, "head_dim": head_dim,
              "hidden_activation": "gelu_pytorch_tanh", "hidden_size": g.HIDDEN,
              "hidden_size_per_layer_input": per_layer, "initializer_range": 0.02,
              "intermediate_size": g.INTERMEDIATE, "layer_types": GEMMA4_LAYER_TYPES,
              "max_position_embeddings": 131072, "model_type": "gemma4_text", "num_attention_heads": g.NUM_HEADS,
              "num_hidden_layers": layers, "num_key_value_heads": g.NUM_KV_HEADS, "num_kv_shared_layers": 2,
              "pad_token_id": 0, "rms_norm_eps": 1e-06,
              "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                                     "rope_type": "proportional"},
                                  "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
              "sliding_window": SLIDING_WINDOW, "tie_word_embeddings": True, "torch_dtype": "float32",
              "transformers_version": "5.5.0", "use_cache": True, "use_double_wide_mlp": False,
              "vocab_size": vocab, "vocab_size_per_layer_input": vocab}
    g.write_json(directory, "config.json", config)
    gen = g.generator("gemma4")

    def norm(size: int, gain: float = 1.0) -> torch.Tensor:
        return gain + 0.1 * torch.randn(size, generator=gen)  # Gemma 4's norms multiply by the weight itself

    tensors = {"model.embed_tokens.weight": g.EMBED_STD * torch.randn(vocab, g.HIDDEN, generator=gen),
               "model.embed_tokens_per_layer.weight": torch.randn(vocab, layers * per_layer, generator=gen),
               "model.per_layer_model_projection.weight": _linear(gen, layers * per_layer, g.HIDDEN),
               "model.per_layer_projection_norm.weight": norm(per_layer), "model.norm.weight": norm(g.HIDDEN, 8.0)}
    for i, kind in enumerate(GEMMA4_LAYER_TYPES):
        p, d = f"model.layers.{i}.", global_head_dim if kind == "full_attention" else head_dim
        tensors[p + "layer_scalar"] = torch.tensor([0.5 + torch.rand(1, generator=gen).item()])
        tensors[p + "self_attn.q_proj.weight"] = _linear(gen, g.NUM_HEADS * d, g.HIDDEN)
        tensors[p + "self_attn.q_norm.weight"] = norm(d)
        if i < layers - config["num_kv_shared_layers"]:
            tensors[p + "self_attn.k_proj.weight"] = _linear(gen, g.NUM_KV_HEADS * d, g.HIDDEN)
            tensors[p + "self_attn.v_proj.weight"] = _linear(gen, g.NUM_KV_HEADS * d, g.HIDDEN)
            tensors[p + "self_attn.k_norm.weight"] = norm(d)
        tensors[p + "self_attn.o_proj.weight"] = _linear(gen, g.HIDDEN, g.NUM_HEADS * d)
        tensors[p + "mlp.gate_proj.weight"] = _linear(gen, g.INTERMEDIATE, g.HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = _linear(gen, g.INTERMEDIATE, g.HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = _linear(gen, g.HIDDEN, g.INTERMEDIATE)
        for name in ("input_layernorm", "pre_feedforward_layernorm", "post_per_layer_input_norm"):
            tensors[p + name + ".weight"] = norm(g.HIDDEN)
        for name in ("post_attention_layernorm", "post_feedforward_layernorm"):
            tensors[p + name + ".weight"] = norm(g.HIDDEN, 4.0)
        tensors[p + "per_layer_input_gate.weight"] = _linear(gen, per_layer, g.HIDDEN)
        tensors[p + "per_layer_projection.weight"] = _linear(gen, g.HIDDEN, per_layer)
    g.save_weights(directory, tensors, torch.float32, num_shards=1)
    return directory


WRITERS = {"qwen3_moe": write_qwen3_moe, "gemma3_text": write_gemma3_text, "phi3": write_phi3,
           "smollm3": write_smollm3, "gpt_oss": write_gpt_oss, "gemma4_text": write_gemma4_text}
FAMILIES = tuple(WRITERS)


def write_family(family: str, directory: Path) -> Path:
    """Write the replica of `family` (one of FAMILIES) into `directory`; returns it."""
    if family not in WRITERS:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    return WRITERS[family](Path(directory))
