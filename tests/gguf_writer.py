"""A transformers model written as a float32 GGUF the way llama.cpp's converter (convert_hf_to_gguf.py)
writes it: its metadata keys, its tensor names (gguf's own name map) and its transforms (llama's q/k rows
permuted), with the tiny vocabulary of tests.gguf_model. For the tests that compare a file ponder reads
with the transformers model it was made from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map

from tests.gguf_model import write_tiny_vocabulary

ARCHES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # model_type -> llama.cpp's architecture


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """The converter's q/k permutation for llama (its rotary halves interleaved, as llama.cpp rotates)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_metadata(writer: GGUFWriter, config, vocab: int) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    write_tiny_vocabulary(writer, vocab)


def write_gguf_of(model: torch.nn.Module, path: Path) -> Path:
    """`model` (a llama, qwen2 or qwen3 of transformers) as a float32 GGUF at `path`."""
    config = model.config
    arch = ARCHES[config.model_type]
    arch_id = next(key for key, name in MODEL_ARCH_NAMES.items() if name == arch)
    names = get_tensor_name_map(arch_id, config.num_hidden_layers)
    writer = GGUFWriter(str(path), arch)
    write_metadata(writer, config, config.vocab_size)
    tied = config.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        base, _, suffix = name.rpartition(".")
        value = tensor.detach().float().numpy().copy()
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            value = _permute(value, heads)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
