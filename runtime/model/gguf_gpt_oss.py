"""gpt-oss's GGUF files (llama.cpp's `gpt-oss` architecture, its openai-moe model) read into transformers'
gpt-oss model: the file's tensor names (`GptOssTensors`, `tensor_names`, which runtime.model.gguf_blocks'
`open_gguf` gives runtime.model.gguf_load); its routed experts are kept in the file's blocks (MXFP4 as
llama-quantize's MXFP4_MOE writes them: runtime.model.gguf_blocks) as one kernel layer an expert, never
a float copy (runtime.model.gguf_experts' `GptOssExpertTensors`).

What llama.cpp's converter (its GptOssModel) writes, and where it goes here:

| the file's tensor | converter | read back |
|---|---|---|
| `blk.N.attn_sinks.weight` | `self_attn.sinks` with `.weight` added | the attention's `sinks` |
| `blk.N.ffn_gate_inp.weight` / `.bias` | the router | transformers' router's, then ponder's float kernel (`KernelRouter`, top-k then softmax) |
| `blk.N.ffn_gate_exps` / `ffn_up_exps` `[experts, I, hidden]` (and `.bias` `[experts, I]`) | `gate_up_proj`'s interleaved columns split: gate the even ones, up the odd ones, each transposed | each expert's gate and up layers side by side (gate rows first), their biases so; the clamped SwiGLU reads the halves (gguf_experts' `HalvesClampedSwiGLU`) where transformers reads even and odd columns |
| `blk.N.ffn_down_exps` `[experts, hidden, I]` (and `.bias`) | `down_proj` transposed | each expert's down layer |
| `blk.N.post_attention_norm.weight` | `post_attention_layernorm` | as is |

An expert's outputs are its own rows' (the kernels compute each output column from its own weights), so
gate and up side by side rather than interleaved give every element transformers' bits. The SwiGLU's
alpha and limit are not in the file (llama.cpp computes with gpt-oss's 1.702 and 7.0, transformers'
GptOssConfig defaults).
"""

from __future__ import annotations

import re

from torch import nn
from transformers.modeling_gguf_pytorch_utils import GGUFTensor, TensorProcessor, get_gguf_hf_weights_map

ARCHITECTURE = "gpt-oss"
MODEL_TYPE = "gpt_oss"
_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_SINKS = re.compile(r"model\.layers\.(\d+)\.self_attn\.sinks$")
_FILE_PARTS = {"gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "down_proj": ("ffn_down_exps",)}


class GptOssTensors(TensorProcessor):
    """transformers' TensorProcessor for gpt-oss's files: the converter's names for the stacked experts
    (and their biases) and the sinks, which gguf's name map gives otherwise or not at all; every tensor's
    values as the file has them."""

    def perform_fallback_tensor_mapping(self, gguf_to_hf_name_map, suffix, qual_name, hf_name):
        match = _EXPERTS.search(hf_name)
        if match:
            for part in _FILE_PARTS[match[2]]:
                gguf_to_hf_name_map[f"blk.{match[1]}.{part}.{'bias' if match[3] else 'weight'}"] = qual_name + hf_name

    def process(self, weights, name, **kwargs):
        return GGUFTensor(weights, name, {})


def tensor_names(model: nn.Module, processor: GptOssTensors) -> dict[str, str]:
    """The file's tensor names -> the model's parameter names."""
    names = get_gguf_hf_weights_map(model, processor, model_type=ARCHITECTURE)
    for key, target in list(names.items()):
        if _EXPERTS.search(target):  # (gguf's map names `down_proj` without a suffix)
            del names[key]
        elif _SINKS.search(target):
            names[f"blk.{_SINKS.search(target)[1]}.attn_sinks.weight"] = names.pop(key)
    for target, _ in model.named_parameters():
        processor.perform_fallback_tensor_mapping(names, "", "", target)
    return names
