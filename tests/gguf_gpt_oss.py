"""A gpt-oss GGUF written with the `gguf` package from the gpt-oss replica's own weights
(tests/replicas/families.py), as llama.cpp's converter (its GptOssModel, from a float checkpoint) writes
them and llama-quantize's MXFP4_MOE types them: `gate_up_proj`'s interleaved columns split into
`ffn_gate_exps` (the even ones) and `ffn_up_exps` (the odd ones), each `[experts, I, hidden]`, and their
biases so; `down_proj` transposed into `ffn_down_exps`; the sinks as `attn_sinks.weight`; the router as
`ffn_gate_inp` (never quantized); yarn's `rope.scaling.*`, the sliding window and the experts' width in the
metadata. The stacked experts are `experts` (MXFP4 as gguf's quantizer writes it, or F32), the other
linear tensors, the embedding and the head `linear` (F32, or Q8_0 as MXFP4_MOE makes them)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import quantize
from safetensors.torch import load_file

from tests.gguf_model import write_tiny_vocabulary

ARCH = "gpt-oss"


def write_gpt_oss_gguf(replica: Path, path: Path, experts: str = "MXFP4", linear: str = "Q8_0") -> Path:
    config = json.loads((replica / "config.json").read_text())
    tensors = {name: t.float().numpy() for name, t in load_file(replica / "model.safetensors").items()}
    rope = config["rope_scaling"]
    writer = GGUFWriter(str(path), ARCH)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    write_tiny_vocabulary(writer, config["vocab_size"])

    def add(name: str, value: np.ndarray, kind: str = "F32") -> None:
        value = np.ascontiguousarray(value, dtype=np.float32)
        if kind == "F32":
            writer.add_tensor(name, value)
            return
        data = quantize(value, GGMLQuantizationType[kind])
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType[kind])

    add("token_embd.weight", tensors["model.embed_tokens.weight"], linear)
    for i in range(config["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", tensors[p + "input_layernorm.weight"])
        add(b + "post_attention_norm.weight", tensors[p + "post_attention_layernorm.weight"])
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            add(f"{b}{ours}.weight", tensors[f"{p}self_attn.{theirs}.weight"], linear)
            add(f"{b}{ours}.bias", tensors[f"{p}self_attn.{theirs}.bias"])
        add(b + "attn_sinks.weight", tensors[p + "self_attn.sinks"])
        add(b + "ffn_gate_inp.weight", tensors[p + "mlp.router.weight"])
        add(b + "ffn_gate_inp.bias", tensors[p + "mlp.router.bias"])
        gate_up = tensors[p + "mlp.experts.gate_up_proj"].transpose(0, 2, 1)  # [experts, 2I, hidden]
        gate_up_bias = tensors[p + "mlp.experts.gate_up_proj_bias"]
        add(b + "ffn_gate_exps.weight", gate_up[:, ::2], experts)
        add(b + "ffn_gate_exps.bias", gate_up_bias[:, ::2])
        add(b + "ffn_up_exps.weight", gate_up[:, 1::2], experts)
        add(b + "ffn_up_exps.bias", gate_up_bias[:, 1::2])
        add(b + "ffn_down_exps.weight", tensors[p + "mlp.experts.down_proj"].transpose(0, 2, 1), experts)
        add(b + "ffn_down_exps.bias", tensors[p + "mlp.experts.down_proj_bias"])
    add("output_norm.weight", tensors["model.norm.weight"])
    add("output.weight", tensors["lm_head.weight"], linear)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized_replica(replica: Path, path: Path, directory: Path) -> Path:
    """`directory`: the replica with every tensor the file holds in blocks replaced by the values gguf
    dequantizes it to, in transformers' layout (gate and up interleaved again): the float model the
    file stands for."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    file = {t.name: dequantize(t.data, t.tensor_type) for t in GGUFReader(str(path)).tensors}
    tensors = load_file(replica / "model.safetensors")
    names = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}
    for i in range(json.loads((replica / "config.json").read_text())["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            names[f"{p}self_attn.{theirs}.weight"] = f"{b}{ours}.weight"
        gate, up = file[b + "ffn_gate_exps.weight"], file[b + "ffn_up_exps.weight"]
        gate_up = np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, gate.shape[2])  # rows g0, u0, g1, ...
        tensors[p + "mlp.experts.gate_up_proj"] = torch.from_numpy(np.ascontiguousarray(gate_up.transpose(0, 2, 1)))
        tensors[p + "mlp.experts.down_proj"] = torch.from_numpy(
            np.ascontiguousarray(file[b + "ffn_down_exps.weight"].transpose(0, 2, 1)))
    for name, tensor_name in names.items():
        tensors[name] = torch.from_numpy(np.array(file[tensor_name]))
    directory.mkdir(parents=True, exist_ok=True)
    for item in replica.iterdir():
        if item.name != "model.safetensors" and item.is_file():
            (directory / item.name).write_bytes(item.read_bytes())
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors")
    return directory
