"""A lean forward pass for llama-family decoders (llama, qwen2) over the paged KV cache.

transformers' modules spend most of a small model's decode step on Python and on many small
operators: three projections where one matmul would do, rotary embeddings applied to queries and
keys separately, a module call (with its hooks and keyword plumbing) per norm, projection and
activation. `LeanDecoder` runs the same arithmetic, operator for operator in the same order and
dtypes, so its logits are transformers' bits (tested), with:

- the q, k and v projections as one matmul, and gate and up as one: their weights are concatenated
  once and the layers' own weights become views of the result (no extra memory; transformers'
  forward still works). Every kernel used computes an output column from its own weights only, so
  the columns keep their bits (tested for each kind of layer);
- rotary embeddings applied to queries and keys in one pass over both;
- no module calls in the layer loop: the weights are read from the modules once.

A model it does not know (another architecture, a projection it cannot fuse, a layer with norms on
queries and keys) is run by transformers' forward; `LeanDecoder.build` says which by returning None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime.attention import AttentionMetadata, paged_attention
from runtime.quantize import QuantizedLinear

ARCHITECTURES = ("llama", "qwen2")


class Projections:
    """Several linear layers that read the same input: one fused matmul split into their outputs, or
    (when the layers cannot be fused) one call each."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.sizes = [layer.out_features for layer in layers]
        self.fused = fuse_linears(layers)
        self.layers = layers

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.fused is None:
            return tuple(layer(x) for layer in self.layers)
        return self.fused(x).split(self.sizes, dim=-1)

    def split_last(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(every output but the last side by side, the last output): a view of the fused output."""
        if self.fused is None:
            *rest, last = (layer(x) for layer in self.layers)
            return torch.cat(rest, dim=-1), last
        y = self.fused(x)
        width = y.shape[-1] - self.sizes[-1]
        return y[..., :width], y[..., width:]


def fuse_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One layer computing `layers`' outputs side by side, the layers' weights becoming views of its
    weight; None when they are not all of one kind that can be fused."""
    kind = type(layers[0])
    if any(type(layer) is not kind or (layer.bias is None) != (layers[0].bias is None) for layer in layers):
        return None
    if kind is nn.Linear:
        first = layers[0].weight
        fused = nn.Linear(first.shape[1], sum(layer.out_features for layer in layers),
                          bias=layers[0].bias is not None, device=first.device, dtype=first.dtype)
        fused.weight = nn.Parameter(torch.cat([layer.weight.detach() for layer in layers]), requires_grad=False)
        if fused.bias is not None:
            fused.bias = nn.Parameter(torch.cat([layer.bias.detach() for layer in layers]), requires_grad=False)
        start = 0
        for layer in layers:
            rows = layer.out_features
            layer.weight = nn.Parameter(fused.weight[start:start + rows], requires_grad=False)
            start += rows
        return fused
    if issubclass(kind, QuantizedLinear) and hasattr(kind, "concatenated"):
        return kind.concatenated(layers)
    return None


@dataclass
class _Norm:
    weight: torch.Tensor
    eps: float

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm / Qwen2RMSNorm, operator for operator
        input_dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.eps)
        return self.weight * hidden.to(input_dtype)


@dataclass
class _Layer:
    attention: nn.Module  # the attention module: its layer_idx and scaling
    input_norm: _Norm
    qkv: Projections
    o_proj: nn.Module
    post_norm: _Norm
    gate_up: Projections
    act: nn.Module
    down: nn.Module


class LeanDecoder:
    """transformers' forward for a llama-family model, with fewer operators (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        base = model.base_model
        config = model.config
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm = _Norm(base.norm.weight, base.norm.variance_epsilon)
        self.head = model.lm_head
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.layers = []
        for layer in base.layers[:config.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                attn, _Norm(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                Projections([attn.q_proj, attn.k_proj, attn.v_proj]), attn.o_proj,
                _Norm(layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                Projections([mlp.gate_proj, mlp.up_proj]), mlp.act_fn, mlp.down_proj))

    @classmethod
    def build(cls, model: nn.Module) -> "LeanDecoder | None":
        """A lean decoder for `model`, or None when its forward must stay transformers' own."""
        config = getattr(model, "config", None)
        if getattr(config, "model_type", None) not in ARCHITECTURES or getattr(config, "pretraining_tp", 1) != 1:
            return None
        base = getattr(model, "base_model", None)
        if base is None or not all(hasattr(base, name) for name in ("embed_tokens", "rotary_emb", "norm", "layers")):
            return None
        if not isinstance(getattr(model, "lm_head", None), nn.Module):
            return None
        for layer in base.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attn is None or mlp is None or hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
                return None
            if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "layer_idx", "scaling")):
                return None
            if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
                return None
        return cls(model)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
        """The final norm's output `[1, T, hidden]` for `input_ids` `[1, T]` at `positions` `[1, T]`."""
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids=positions)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [1, T, 1, D]: one head axis for queries and keys
        num_tokens = input_ids.shape[1]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        for layer in self.layers:
            residual = hidden
            qk, v = layer.qkv.split_last(layer.input_norm(hidden))
            # Queries and keys rotated together: the same elementwise arithmetic as transformers' two passes.
            qk = qk.view(1, num_tokens, heads + kv_heads, dim)
            half = dim // 2
            rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk = (qk * cos) + (rotated * sin)
            query = qk[:, :, :heads].transpose(1, 2)
            key = qk[:, :, heads:].transpose(1, 2)
            value = v.view(1, num_tokens, kv_heads, dim).transpose(1, 2)
            out, _ = paged_attention(layer.attention, query, key, value, None, scaling=layer.attention.scaling,
                                     ponder_attention=meta)
            hidden = residual + layer.o_proj(out.reshape(1, num_tokens, -1).contiguous())
            residual = hidden
            gate, up = layer.gate_up(layer.post_norm(hidden))
            hidden = residual + layer.down(layer.act(gate) * up)
        return self.norm(hidden)

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               keep: torch.Tensor) -> torch.Tensor:
        """The head's output `[1, len(keep), vocab]` at rows `keep` of the step."""
        return self.head(self.hidden_states(input_ids, positions, meta)[:, keep, :])
