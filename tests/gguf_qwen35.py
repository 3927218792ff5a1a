"""A Qwen3.5 text model's tensors written as a GGUF the way llama.cpp's converter writes them
(convert_hf_to_gguf.py's Qwen3_5TextModel: Qwen3NextModel's transforms after _LinearAttentionVReorderBase's
value-head reorder): `-exp(A_log)`, `dt_bias` as `ssm_dt.bias`, the conv1d squeezed, `weight + 1` for
every norm but the gated one, and, where the key heads are fewer than the value heads, the value heads
tiled (`[G0v0, G1v0, G0v1, ...]`) in the value rows, channels and columns; the names from gguf's own map,
its metadata keys (`ssm.*`, `attention.recurrent_layers`, `full_attention_interval`, the mrope's).

`to_file(name, value, config)` is the converter's transform of one tensor: the tests apply it to what ponder
loaded to compare with the file's dequantized tensors, independently of ponder's inverse."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf.quants import quantize

from tests.gguf_model import write_tiny_vocabulary
from tests.replicas.hybrid import _meta_shapes, _tensor, qwen35_text_config
from tests.replicas.generators import generator

ARCH = "qwen35"
MOE_ARCH = "qwen35moe"


def _tiled(x: torch.Tensor, dim: int, config: dict, head_dim: int) -> torch.Tensor:
    """The converter's `_reorder_v_heads`: value heads grouped by key head -> tiled."""
    num_k, num_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    shape = list(x.shape)
    split = shape[:dim] + [num_k, num_v // num_k, head_dim] + shape[dim + 1:]
    return x.reshape(split).transpose(dim, dim + 1).contiguous().reshape(shape)


def to_file(name: str, value: torch.Tensor, config: dict) -> tuple[str, torch.Tensor]:
    """(the converter's name before gguf's map, the tensor it writes) for transformers' `name`."""
    tiled = config["linear_num_key_heads"] != config["linear_num_value_heads"]
    head_v, key_dim = config["linear_value_head_dim"], config["linear_key_head_dim"] * config["linear_num_key_heads"]
    if tiled and "linear_attn." in name:
        if ".in_proj_qkv." in name:
            value = torch.cat([value[:2 * key_dim], _tiled(value[2 * key_dim:], 0, config, head_v)])
        elif ".in_proj_z." in name:
            value = _tiled(value, 0, config, head_v)
        elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
            value = _tiled(value, 0, config, 1)
        elif ".conv1d" in name:
            value = value.squeeze()
            value = torch.cat([value[:2 * key_dim], _tiled(value[2 * key_dim:], 0, config, head_v)])
        elif ".out_proj." in name:
            value = _tiled(value, 1, config, head_v)
    if name.endswith(".A_log"):
        value = -torch.exp(value)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        value = value.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        value = value + 1
    return name, value


def wide_text_config(vocab: int = 448) -> dict:
    """The replica's text config with every projection's input 256 wide (a K-quant's super-block)."""
    config = qwen35_text_config(vocab, 2, 1)
    config.update(hidden_size=256, intermediate_size=256, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64)
    config["rope_parameters"] = {**config["rope_parameters"], "mrope_section": [4, 2, 2]}
    return config


def replica_tensors(config: dict, seed_name: str = "qwen35_wide") -> dict[str, torch.Tensor]:
    """Seeded tensors (as tests/replicas/hybrid.py makes them) under transformers' names for `config`."""
    g = generator(seed_name)
    return {key: _tensor(key, shape, g) for key, shape in sorted(_meta_shapes(config).items())}


def centered_q4_k(rows: int, cols: int, rng: np.random.Generator, scale: float = 0.004) -> np.ndarray:
    """Q4_K blocks of random codes whose groups are centred on zero (a min of 7.5 times the scale, the
    super-block's dmin equal to its d): gguf has no Q4_K quantizer, and random bytes' groups, each with
    an offset of its own, drive a random model to one token whatever the prompt."""
    blocks = rows * cols // 256
    d = (rng.random(blocks) * scale / 2 + scale / 2).astype(np.float16)
    sc = rng.integers(1, 9, (blocks, 8), dtype=np.uint8)
    mn = np.round(7.5 * sc).astype(np.uint8)
    packed = np.empty((blocks, 12), np.uint8)  # ggml's get_scale_min_k4 layout
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    codes = rng.integers(0, 256, (blocks, 128), dtype=np.uint8)
    halves = d.view(np.uint8).reshape(blocks, 2)
    return np.concatenate([halves, halves, packed, codes], axis=1).reshape(rows, -1)


def write_qwen35_gguf(config: dict, tensors: dict[str, torch.Tensor], path: Path, kind: str = "F32",
                      embedding: str | None = None) -> Path:
    """`tensors` (transformers' Qwen3.5 or Qwen3.5-MoE text names, `config` its text config as a dict) at `path`, every
    projection `kind` (F32, a type gguf quantizes, or Q4_K: `centered_q4_k`), the token embedding `embedding` (default: `kind`'s, F32 for F32), the rest F32."""
    layers = config["num_hidden_layers"]
    moe = config["model_type"] == "qwen3_5_moe_text"
    arch = MOE_ARCH if moe else ARCH
    names = get_tensor_name_map(MODEL_ARCH.QWEN35MOE if moe else MODEL_ARCH.QWEN35, layers)
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    if moe:
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    rope = config["rope_parameters"]
    writer.add_rope_dimension_sections([*rope["mrope_section"], 0, 0, 0][:4])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    writer.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in config["layer_types"]])
    writer.add_full_attention_interval(config.get("full_attention_interval", 4))
    writer.add_rope_dimension_count(int(config["head_dim"] * rope["partial_rotary_factor"]))
    write_tiny_vocabulary(writer, config["vocab_size"])
    rng = np.random.default_rng(0)

    def add(name: str, value: np.ndarray, qtype: str) -> None:
        if qtype == "F32":
            writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
            return
        if qtype == "Q4_K":  # (a stacked experts tensor: an expert's blocks after another's)
            data = np.stack([centered_q4_k(*v.shape, rng) for v in value]) if value.ndim == 3 else \
                centered_q4_k(*value.shape, rng)
        else:
            data = quantize(np.ascontiguousarray(value, dtype=np.float32), GGMLQuantizationType[qtype])
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType[qtype])

    for name, tensor in tensors.items():
        if name == "lm_head.weight" and config["tie_word_embeddings"]:
            continue
        if ".mlp.experts." in name:  # the converter's stacked experts: gate/up split, `[experts, out, in]` each
            block, value = name.split(".")[2], tensor.detach().float().numpy()
            parts = {"down": value} if name.endswith("down_proj") else dict(zip(("gate", "up"), np.split(value, 2, axis=1)))
            for part, stacked in parts.items():
                add(f"blk.{block}.ffn_{part}_exps.weight", stacked, kind)
            continue
        renamed, value = to_file(name, tensor.detach().float(), config)
        gguf_name = names.get_name(renamed, try_suffixes=(".weight", ".bias"))  # (as the converter's map_tensor_name)
        value = value.numpy()
        if name == "model.embed_tokens.weight":
            qtype = embedding or kind
        elif value.ndim == 2 and "conv1d" not in name and not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            qtype = kind  # (the routers stay F32, as the converter writes them)
        else:
            qtype = "F32"
        add(gguf_name, value, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
