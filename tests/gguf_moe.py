"""A Qwen3-MoE GGUF written with the `gguf` package from the Qwen3-MoE replica's own weights
(tests/replicas/families.py), laid out as llama.cpp's converter writes them: the experts as stacked
`blk.N.ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps` tensors `[experts, out, in]`, the router as
`ffn_gate_inp` in F32, `expert_count`, `expert_used_count` and `expert_feed_forward_length` in the
metadata. The linear tensors are `kind` (F32 for exactness against transformers on the same weights,
Q8_0 / Q4_0 / Q4_1 as gguf's quantizer writes them)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file

ARCH = "qwen3moe"


def write_qwen3_moe_gguf(replica: Path, path: Path, kind: str = "F32") -> Path:
    config = json.loads((replica / "config.json").read_text())
    tensors = {name: t.float().numpy() for name, t in load_file(replica / "model.safetensors").items()}
    vocab, layers = config["vocab_size"], config["num_hidden_layers"]
    writer = GGUFWriter(str(path), ARCH)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config.get("intermediate_size", config["moe_intermediate_size"]))
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_tokenizer_model("llama")  # (the vocabulary is not under test: token ids are)
    writer.add_token_list([f"<t{i}>".encode() for i in range(vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([1] * vocab)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    qtype = GGMLQuantizationType[kind]

    def linear(name: str, value: np.ndarray) -> None:
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
            return
        data = quantize(np.ascontiguousarray(value, dtype=np.float32), qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    def floats(name: str, value: np.ndarray) -> None:
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))

    floats("token_embd.weight", tensors["model.embed_tokens.weight"])
    floats("output_norm.weight", tensors["model.norm.weight"])
    linear("output.weight", tensors["lm_head.weight"])
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        floats(b + "attn_norm.weight", tensors[p + "input_layernorm.weight"])
        floats(b + "ffn_norm.weight", tensors[p + "post_attention_layernorm.weight"])
        floats(b + "attn_q_norm.weight", tensors[p + "self_attn.q_norm.weight"])
        floats(b + "attn_k_norm.weight", tensors[p + "self_attn.k_norm.weight"])
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            linear(f"{b}{ours}.weight", tensors[f"{p}self_attn.{theirs}.weight"])
        floats(b + "ffn_gate_inp.weight", tensors[p + "mlp.gate.weight"])
        for ours, theirs in (("ffn_gate_exps", "gate_proj"), ("ffn_up_exps", "up_proj"), ("ffn_down_exps", "down_proj")):
            stacked = np.stack([tensors[f"{p}mlp.experts.{e}.{theirs}.weight"] for e in range(config["num_experts"])])
            linear(f"{b}{ours}.weight", stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def replica_model(replica: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(replica, dtype=torch.float32).eval()
