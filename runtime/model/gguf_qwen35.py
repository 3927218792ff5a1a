"""Qwen3.5's GGUF tensors (llama.cpp's `qwen35` and `qwen35moe`) read back into transformers' Qwen3.5 text
model, the converter's transforms (convert_hf_to_gguf.py's Qwen3NextModel and _LinearAttentionVReorderBase)
inverted tensor by tensor. transformers has no GGUF mapping for the family; `Qwen35Tensors` is the
tensor processor runtime.model.gguf_load calls as it calls transformers' own for the other families.

What the converter does, and what is done back here:

| the file's tensor | converter | read back |
|---|---|---|
| `blk.N.ssm_a` | `-exp(A_log)` | `A_log`: the float32 whose `-exp` (torch's, as transformers computes the decay) is the file's value, where one exists (see `decay_log`) |
| `blk.N.ssm_dt.bias` | `dt_bias` renamed | as is |
| `blk.N.ssm_conv1d.weight` | `[channels, 1, kernel]` squeezed | the middle axis put back |
| `*norm.weight` but `ssm_norm` | `weight + 1` (transformers' norms multiply by `1 + weight`) | `value - 1` |
| value heads, where key heads are fewer | grouped by key head -> tiled (`[G0v0, G1v0, G0v1, ...]`) in `attn_qkv`'s value rows, `attn_gate`, `ssm_beta`, `ssm_alpha`, `ssm_a`, `ssm_dt`, `ssm_conv1d`'s value channels and `ssm_out`'s columns | rows grouped back; `ssm_out` kept in its blocks with its columns as the file has them, its input gathered into that order (`InputOrder`) |

A norm's `value - 1` is exact (and `1 + (value - 1)`, what transformers multiplies by, the file's value)
for every value at or above 0.5 and every value a bfloat16 checkpoint's `weight + 1` gives; `decay_log`
is exact wherever the file's decay is float32's exp of a float32 (a float32 checkpoint's). Elsewhere each
is the nearest float32, one unit in the last place from llama.cpp's value.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from torch import nn
from transformers.modeling_gguf_pytorch_utils import GGUFTensor, TensorProcessor

ARCHITECTURES = ("qwen35", "qwen35moe")
# norms transformers multiplies by (1 + weight), which the converter wrote as weight + 1
_OFFSET_NORMS = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm")
_DT_BIAS = re.compile(r"layers\.(\d+)\.linear_attn\.dt_bias$")
_GATE_UP_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.gate_up_proj$")


def decay_log(decay: np.ndarray) -> np.ndarray:
    """`A_log` (float32) for the file's `A = -exp(A_log)`: log(-A), stepped a float at a time until
    torch's float32 exp gives -A exactly (the converter's own exp of the checkpoint's float32 A_log
    has such a preimage; a bfloat16 one's may not, and the nearest is kept)."""
    target = torch.from_numpy(np.ascontiguousarray(-decay, dtype=np.float32))
    x = torch.log(target.double()).float()
    up, down = torch.full_like(x, np.inf), torch.full_like(x, -np.inf)
    for _ in range(16):
        y = x.exp()
        if torch.equal(y, target):
            break
        x = torch.where(y < target, torch.nextafter(x, up), torch.where(y > target, torch.nextafter(x, down), x))
    return x.numpy()


class Qwen35Tensors(TensorProcessor):
    """transformers' TensorProcessor for Qwen3.5's files: `process` gives a tensor as transformers'
    parameter holds it, `input_order` the order `ssm_out`'s columns are stored in."""

    def __init__(self, config=None):
        super().__init__(config)
        config = self.config
        self.num_k_heads = config["linear_num_key_heads"]
        self.num_v_heads = config["linear_num_value_heads"]
        self.head_k_dim = config["linear_key_head_dim"]
        self.head_v_dim = config["linear_value_head_dim"]
        self.is_tiled = self.num_k_heads != self.num_v_heads  # (the converter reorders only then)

    def perform_fallback_tensor_mapping(self, gguf_to_hf_name_map, suffix, qual_name, hf_name):
        # the converter renames `dt_bias` to `dt_proj.bias` before gguf's name map makes it `ssm_dt.bias`
        match = _DT_BIAS.search(hf_name)
        if match:
            gguf_to_hf_name_map[f"blk.{match[1]}.ssm_dt.bias"] = qual_name + hf_name
        # Qwen3.5-MoE's stacked gate/up experts: the converter splits them into two tensors
        match = _GATE_UP_EXPERTS.search(hf_name)
        if match:
            for part in ("gate", "up"):
                gguf_to_hf_name_map[f"blk.{match[1]}.ffn_{part}_exps{suffix}"] = qual_name + hf_name

    def _grouped(self, x: np.ndarray, axis: int, head_dim: int) -> np.ndarray:
        """`x`'s value heads along `axis` from the file's tiled order back to grouped by key head."""
        shape = x.shape
        per_key = self.num_v_heads // self.num_k_heads
        split = (*shape[:axis], per_key, self.num_k_heads, head_dim, *shape[axis + 1:])
        return np.ascontiguousarray(x.reshape(split).swapaxes(axis, axis + 1).reshape(shape))

    def input_order(self, name: str) -> torch.Tensor | None:
        """For `ssm_out` in a file whose value heads are tiled: the input features its stored columns
        hold (column j weighs feature order[j]), else None."""
        if not (self.is_tiled and _part(name) == "ssm_out"):
            return None
        width = self.num_v_heads * self.head_v_dim
        per_key = self.num_v_heads // self.num_k_heads
        grouped = torch.arange(width).reshape(self.num_k_heads, per_key, self.head_v_dim)
        return grouped.transpose(0, 1).reshape(width).contiguous()

    def process(self, weights, name, **kwargs):
        part = _part(name)
        if self.is_tiled:
            key_dim = self.num_k_heads * self.head_k_dim
            if part in ("attn_qkv", "ssm_conv1d"):  # q and k rows (channels) first, as they are
                weights = np.concatenate([weights[:2 * key_dim], self._grouped(weights[2 * key_dim:], 0, self.head_v_dim)])
            elif part == "attn_gate":
                weights = self._grouped(weights, 0, self.head_v_dim)
            elif part in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"):
                weights = self._grouped(weights, 0, 1)
            elif part == "ssm_out" and weights.ndim == 2 and weights.shape[1] == self.num_v_heads * self.head_v_dim:
                weights = self._grouped(weights, 1, self.head_v_dim)  # (a row order's probe is one column wide)
        if part == "ssm_a":  # (in the model's order: torch's exp may round a vector's tail otherwise than its body)
            weights = decay_log(weights)
        elif part in _OFFSET_NORMS:
            weights = (weights.astype(np.float32) - np.float32(1)).astype(np.float32)
        elif part == "ssm_conv1d":
            weights = weights.reshape(weights.shape[0], 1, -1)
        elif part == "ffn_gate_inp_shexp":  # (Qwen3.5-MoE's shared expert's gate: one output, written as a vector)
            weights = weights.reshape(1, -1)
        return GGUFTensor(weights, name, {})


def _part(name: str) -> str:
    """`blk.3.ssm_a` -> `ssm_a`, `output_norm.weight` -> `output_norm`."""
    pieces = name.split(".")
    return pieces[2] if pieces[0] == "blk" and len(pieces) > 2 else pieces[0]


class InputOrder(nn.Module):
    """A linear layer whose stored columns hold the input features in `order` (column j weighs feature
    order[j]): it computes layer(x[..., order]), the file's blocks kept as they are."""

    def __init__(self, layer: nn.Module, order: torch.Tensor) -> None:
        super().__init__()
        self.layer = layer
        self.register_buffer("order", order)
        self.in_features, self.out_features = layer.in_features, layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.index_select(-1, self.order))

    def dequantized(self) -> torch.Tensor:
        """The weight in transformers' column order."""
        weight = self.layer.dequantized()
        restored = torch.empty_like(weight)
        restored[:, self.order] = weight
        return restored
