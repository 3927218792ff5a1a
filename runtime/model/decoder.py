"""A lean forward pass for llama-family decoders over the paged KV cache (llama, qwen2, qwen3, smollm3,
qwen3_moe, gemma3_text, gpt_oss).

transformers' modules spend most of a small model's decode step on Python and on many small
operators: three projections where one matmul would do, rotary embeddings applied to queries and
keys separately, a module call (with its hooks and keyword plumbing) per norm, projection and
activation. `LeanDecoder` runs the same arithmetic, operator for operator in the same order and
dtypes, so its logits are transformers' bits (tested; int4 layers aside, see below), with:

- the q, k and v projections as one matmul, and gate and up as one: their weights are concatenated
  once and the layers' own weights become views of the result (no extra memory; transformers'
  forward still works). Every kernel used computes an output column from its own weights only, so
  the columns keep their bits (tested for each kind of layer);
- rotary embeddings applied to queries and keys in one pass over both;
- no module calls in the layer loop: the weights are read from the modules once.

With int4 layers throughout (and float32 activations), a layer is four calls of ponder's int4 kernel
(runtime.kernels.cpu_kernels; it also computes the norms before the qkv and gate/up projections and adds
the residuals), rotary, attention, and the head norms and silu(gate) * up in ponder's own arithmetic
(small_ops): logits close to transformers' (tested), not its bits; a row is computed from its own inputs.

A step whose every row the decode kernel attends runs the whole layer stack as one call of ponder's
`int4_layers` kernel (`LayerStack`), with the same operators in the same order as the Python loop (the
same bits, tested): where every layer is int4, and where every projection runs in ponder's float kernel
(runtime.model.float_layers: a float model on a CPU, an F16 GGUF).

Qwen3's per-head RMS norms on queries and keys (over head_dim, which need not be hidden / heads) run between
the qkv projection and the rotary, as transformers runs them; SmolLM3's NoPE layers skip the rotary; a
layer's sliding window (Qwen2/Qwen3's `layer_types`) bounds its attention. The stack kernel does the same,
in the same operators. Qwen3-MoE's routed MLP blocks run as runtime.model.experts' `RoutedMLP`
(transformers' reference loop's arithmetic, rows grouped by expert); over kernel experts and router the
stack kernel runs them too (runtime/kernels/csrc/routed_experts.cpp, the same operators; over int4
experts the block is one op in ponder's own arithmetic, norm and residual included, that both call:
routed_int4.cpp). gpt-oss's layers
run the Python loop (biased o projections and experts are not the stack kernel's): its yarn rotary (one
angle a pair of halves), sinks, sliding layers, norms and `RoutedMLP` (top-k, softmax, clamped SwiGLU).
Gemma 3's layers (gemma3_text) run the Python loop: its (1 + w) norms (runtime.model.norms), the norms of
the attention's and the MLP's outputs, GeGLU, and a rotary of their own for its sliding layers are the
Python loop's only; its scaled embedding is its module's call, `query_pre_attn_scalar` its layers'
scaling, and its final soft-capping (if set) follows the head.

A model it does not know (another architecture, a projection it cannot fuse) is run by transformers'
forward; `LeanDecoder.build` says which by returning None.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from runtime.kernels.cpu_kernels import small_ops
from runtime.model.attention import AttentionMetadata, attend
from runtime.model.block_embedding import embedding_dtype
from runtime.model.experts import SILU, RoutedMLP
from runtime.model.float_layers import FloatLinear
from runtime.model.layer_stack import LayerStack, head_norm_weights
from runtime.model.norms import Norm, is_kernel_form, norm_of
from runtime.model.projections import Projections, rows_call
from runtime.model.quantize import Int4Linear, QuantizedLinear

ARCHITECTURES = ("llama", "mistral", "phi3", "qwen2", "qwen3", "smollm3", "qwen3_moe", "gemma3_text", "gpt_oss")


@dataclass
class _Layer:
    index: int
    scaling: float
    input_norm: Norm
    qkv: Projections
    o_proj: object  # rows_call of the layer
    post_norm: Norm
    gate_up: Projections | None  # None (and act, down too) where the MLP is routed over experts (`moe`)
    act: nn.Module | None
    down: object
    # int4 or float (see `LeanDecoder.int4`, `LeanDecoder.floats`): the o and down layers, which the
    # stack kernel calls (an int4 one also adds the residual; the fused qkv and gate/up layers, which
    # also take the norm, are `qkv.fused` and `gate_up.fused`)
    o_module: QuantizedLinear | None = None
    down_module: QuantizedLinear | None = None
    # Qwen3's RMS norms over each query and key head (None: none), whether the layer rotates its
    # queries and keys (SmolLM3's NoPE layers do not), its sliding window (None: full attention)
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    rotary: bool = True
    window: int | None = None
    moe: RoutedMLP | None = None
    # Gemma 3's norms of the attention's and the MLP's outputs before each residual add (its
    # post_attention_layernorm and post_feedforward_layernorm; `post_norm` is then its
    # pre_feedforward_layernorm), and the rotary its layer type has (None: the model's one rotary)
    attn_out_norm: Norm | None = None
    mlp_out_norm: Norm | None = None
    rope: str | None = None
    # gpt-oss's attention sinks `[heads]` (None: none); an int4 layer's head norms' weights
    # (head_norm_weights) and whether silu(gate) * up runs in small_ops.cpp's arithmetic
    sinks: torch.Tensor | None = None
    head_norms: torch.Tensor | None = None
    silu_mul: bool = False

    def is_kernel_form(self) -> bool:
        """Whether ponder's kernels, which fuse llama's norm into a projection, compute this layer."""
        return self.attn_out_norm is None and self.mlp_out_norm is None and \
            is_kernel_form(self.input_norm, self.post_norm, self.q_norm, self.k_norm)

    def queries_and_keys(self, qk: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, normed=False):
        """`qk` [T, H + KVH, D] (the qkv projection's queries then keys) normed per head (unless `normed`),
        rotated as transformers does: each norm over its heads, then x * cos + x rolled by D / 2 * sin."""
        if self.q_norm is not None and not normed:
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        if not self.rotary:
            return qk
        # Queries and keys rotated together: the same elementwise arithmetic as transformers' two passes.
        return (qk * cos) + (torch.roll(qk, qk.shape[-1] // 2, dims=-1) * sin)


def _gate_up(mlp: nn.Module) -> Projections:
    if hasattr(mlp, "gate_up_proj"):  # Phi-3's: one layer, the gate's rows then the up projection's
        half = mlp.gate_up_proj.out_features // 2
        return Projections([mlp.gate_up_proj], [half, half])
    return Projections([mlp.gate_proj, mlp.up_proj])


def layer_window(config, attn) -> int | None:
    """A layer's sliding window: its attention's own (Qwen2/3, SmolLM3, Ministral, Gemma 3 set it a
    layer), or Mistral's and Phi-3's config-wide one (their attention passes `config.sliding_window` to
    every layer)."""
    if config.model_type in ("mistral", "phi3"):
        return getattr(config, "sliding_window", None) or None
    return getattr(attn, "sliding_window", None) or None


class LeanDecoder:
    """transformers' forward for a llama-family model, with fewer operators (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        base = model.base_model
        config = model.config
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm = norm_of(base.norm)
        self.head = model.lm_head
        self.final_softcap = getattr(config, "final_logit_softcapping", None) or None
        # Gemma 3's rotary takes the layer's type: sliding layers have their own base (rope_local_base_freq)
        per_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.layers = []
        for layer in base.layers[:config.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            moe = RoutedMLP(mlp) if RoutedMLP.takes(mlp) else None
            sandwich = hasattr(layer, "pre_feedforward_layernorm")
            self.layers.append(_Layer(
                attn.layer_idx, attn.scaling, norm_of(layer.input_layernorm),
                self._qkv(attn), rows_call(attn.o_proj),
                norm_of(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm),
                *((None, None, None) if moe else (_gate_up(mlp), getattr(mlp, "act_fn", None) or mlp.activation_fn,
                                                  rows_call(mlp.down_proj))),
                q_norm=norm_of(getattr(attn, "q_norm", None)), k_norm=norm_of(getattr(attn, "k_norm", None)),
                rotary=bool(getattr(attn, "use_rope", True)), window=layer_window(config, attn),
                moe=moe, attn_out_norm=norm_of(layer.post_attention_layernorm) if sandwich else None,
                mlp_out_norm=norm_of(layer.post_feedforward_layernorm) if sandwich else None,
                rope=config.layer_types[attn.layer_idx] if per_type else None, sinks=getattr(attn, "sinks", None)))
        self.rope_kinds = tuple(dict.fromkeys(layer.rope for layer in self.layers))
        # With int4 layers throughout and float32 activations, a layer is four kernel calls that
        # also apply the norms and add the residuals (see the module docstring).
        sources = [(layer.self_attn.o_proj, getattr(layer.mlp, "down_proj", None))
                   for layer in base.layers[:config.num_hidden_layers]]
        # (ponder's kernels compute llama's norms and one rotary: Gemma 3's layers run the Python loop)
        self.kernel_form = len(self.rope_kinds) == 1 and is_kernel_form(self.norm) and \
            all(layer.is_kernel_form() for layer in self.layers)
        self.int4 = self.kernel_form and self.kernel_layers(Int4Linear, sources, (torch.float32,))
        # With ponder's float kernel throughout, the Python loop stays the float one (its own norms
        # and adds), and a step the decode kernel wholly attends is one stack-kernel call too (float32
        # or bfloat16 activations).
        self.floats = self.kernel_form and not self.int4 and \
            self.kernel_layers(FloatLinear, sources, (torch.float32, torch.bfloat16))
        if self.int4 or self.floats:
            for layer, (o_proj, down) in zip(self.layers, sources):
                layer.o_module, layer.down_module = o_proj, down
        self.small_ops = small_ops() if self.int4 else None
        for layer in self.layers if self.int4 else ():
            layer.silu_mul = layer.moe is None and type(layer.act) in SILU and len(set(layer.gate_up.sizes)) == 1
            if layer.q_norm is not None and layer.q_norm.eps == layer.k_norm.eps:
                layer.head_norms = head_norm_weights(layer, self.num_heads, self.num_kv_heads)
        head = self.head
        self.head_int4 = head if self.int4 and isinstance(head, Int4Linear) and head.bias is None and \
            self.final_softcap is None else None
        self.stack = LayerStack.build(self) if self.int4 or self.floats else None
        # The Triton kernels' layer loop for a GPU's decode steps (runtime.model.gpu_layers), where a runner
        # asks for it (`use_gpu_layers`); None: the loops below
        self.gpu = None

    def _qkv(self, attn: nn.Module) -> Projections:
        if hasattr(attn, "qkv_proj"):  # Phi-3's: one layer, the queries', keys' and values' rows in turn
            kv = self.num_kv_heads * self.head_dim
            return Projections([attn.qkv_proj], [self.num_heads * self.head_dim, kv, kv])
        return Projections([attn.q_proj, attn.k_proj, attn.v_proj])

    def use_gpu_layers(self) -> bool:
        """Run every step the Triton kernels' loop covers there; False where the layers are not of its form."""
        if self.gpu is None:
            from runtime.model.gpu_layers import GpuLayers

            self.gpu = GpuLayers.build(self)
        return self.gpu is not None

    def kernel_layers(self, kind: type, sources: list[tuple[nn.Module, nn.Module]], dtypes: tuple) -> bool:
        """Whether every layer's projections are `kind` (qkv and gate/up fused, o and down without a
        bias) and the activations of one of `dtypes`."""
        return embedding_dtype(self.embed) in dtypes and all(
            isinstance(layer.qkv.fused, kind) and isinstance(pair[0], kind) and pair[0].bias is None and (
                layer.moe.all_kernel(kind) if layer.moe else
                isinstance(layer.gate_up.fused, kind) and isinstance(pair[1], kind) and pair[1].bias is None)
            for layer, pair in zip(self.layers, sources))

    @classmethod
    def build(cls, model: nn.Module) -> "LeanDecoder | None":
        """A lean decoder for `model`, or None when its forward must stay transformers' own. A model
        has one: the generator's runner and the judge's share it (and its fused weights)."""
        built = getattr(model, "_ponder_lean_decoder", None)
        if built is not None:
            return built
        config = getattr(model, "config", None)
        # (transformers' forward no longer reads `pretraining_tp`; SmolLM3's published config sets 2)
        if getattr(config, "model_type", None) not in ARCHITECTURES or \
                (config.model_type == "llama" and getattr(config, "pretraining_tp", 1) != 1):
            return None
        # (transformers' Gemma 3 keeps `attn_logit_softcapping` without applying it: its forward stays the
        # judge of what such a config means; a bidirectional one is refused before load, runtime.model.families)
        if getattr(config, "attn_logit_softcapping", None) or getattr(config, "use_bidirectional_attention", None):
            return None
        # (a rotary over part of each head, Phi-4-mini's 0.75: the decoder rotates whole heads)
        if (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0) != 1.0:
            return None
        base = getattr(model, "base_model", None)
        if base is None or not all(hasattr(base, name) for name in ("embed_tokens", "rotary_emb", "norm", "layers")) \
                or norm_of(base.norm) is None:
            return None
        if not isinstance(getattr(model, "lm_head", None), nn.Module):
            return None
        for layer in base.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attn is None or mlp is None or hasattr(attn, "q_norm") != hasattr(attn, "k_norm"):
                return None
            norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm") if hasattr(layer, "pre_feedforward_layernorm") else \
                ("input_layernorm", "post_attention_layernorm")
            if any(norm_of(getattr(layer, n, None)) is None for n in norms) or \
                    hasattr(attn, "q_norm") and (norm_of(attn.q_norm) is None or norm_of(attn.k_norm) is None):
                return None
            if not all(hasattr(attn, n) for n in ("o_proj", "layer_idx", "scaling")) or not (
                    all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")) or hasattr(attn, "qkv_proj")):
                return None
            if not RoutedMLP.takes(mlp) and not (hasattr(mlp, "down_proj") and (
                    all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "act_fn")) or
                    all(hasattr(mlp, n) for n in ("gate_up_proj", "activation_fn")))):
                return None
        decoder = cls(model)
        model._ponder_lean_decoder = decoder
        return decoder

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata, normed: bool = True) -> torch.Tensor:
        """The final norm's output `[T, hidden]` for `input_ids` `[1, T]` at `positions` `[1, T]`
        (the residual stream before it with `normed=False`)."""
        hidden = self.embed(input_ids[0])  # (a GGUF's may keep its blocks: runtime.model.block_embedding)
        rotations = {kind: self.rotation(hidden, positions, kind) for kind in self.rope_kinds}
        cos, sin = rotations[self.rope_kinds[0]]  # (the kernels' loops: models of one rotary only)
        num_tokens = input_ids.shape[1]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        if self.gpu is not None and self.gpu.covers(meta):
            return self.gpu(hidden, rotations, meta, normed)
        if self.int4:
            hidden = self._int4_layers(hidden, cos, sin, meta)
            return self.norm(hidden) if normed else hidden
        if self.stack is not None and self.stack.covers(meta):
            hidden = self.stack(hidden, cos, sin, meta)
            return self.norm(hidden) if normed else hidden
        for layer in self.layers:
            residual = hidden
            qk, v = layer.qkv.split_last(layer.input_norm(hidden))
            qk = layer.queries_and_keys(qk.view(num_tokens, heads + kv_heads, dim), heads, *rotations[layer.rope])
            out = attend(meta, layer.index, qk[:, :heads], qk[:, heads:], v.view(num_tokens, kv_heads, dim),
                         layer.scaling, window=layer.window, sinks=layer.sinks)
            out = layer.o_proj(out.view(num_tokens, heads * dim))
            hidden = residual + (out if layer.attn_out_norm is None else layer.attn_out_norm(out))
            residual = hidden
            if layer.moe is not None:
                hidden = residual + layer.moe(layer.post_norm(hidden))
                continue
            gate, up = layer.gate_up(layer.post_norm(hidden))
            out = layer.down(layer.act(gate) * up)
            hidden = residual + (out if layer.mlp_out_norm is None else layer.mlp_out_norm(out))
        return self.norm(hidden) if normed else hidden

    def rotation(self, hidden: torch.Tensor, positions: torch.Tensor, kind: str | None):
        """(cos, sin) `[T, 1, D]` of the rotary of layers of type `kind` (None: the model's one rotary)."""
        cos, sin = self.rotary(hidden, position_ids=positions, **({} if kind is None else {"layer_type": kind}))
        half = self.head_dim // 2
        if cos.shape[-1] == half:  # gpt-oss's: one angle a pair, x1 * cos - x2 * sin and x2 * cos + x1 * sin
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # (the same products)
        # transformers rotates x as x * cos + cat(-x2, x1) * sin; cat(x2, x1) * cat(-sin1, sin2) is the
        # same bits ((-a) * b == a * (-b) exactly), one operator fewer a layer.
        return cos[0, :, None], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)[:, None]

    def _int4_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     meta: AttentionMetadata) -> torch.Tensor:
        """The residual stream after every layer, each layer four int4 kernel calls (see `int4`)."""
        if self.stack is not None and self.stack.covers(meta):
            return self.stack(hidden, cos, sin, meta)
        num_tokens = hidden.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        for layer in self.layers:
            norm = layer.input_norm
            qkv = layer.qkv.fused.fused_rows(hidden, norm.weight, norm.eps)
            if layer.qkv.fused.bias is not None:
                qkv = qkv + layer.qkv.fused.bias
            normed = layer.head_norms is not None  # (then in ponder's own arithmetic, as the stack kernel's)
            qk = self.small_ops[0](qkv, heads + kv_heads, layer.head_norms, layer.q_norm.eps) if normed else \
                qkv[:, :(heads + kv_heads) * dim].view(num_tokens, -1, dim)
            qk = layer.queries_and_keys(qk, heads, cos, sin, normed=normed)
            v = qkv[:, (heads + kv_heads) * dim:].reshape(num_tokens, kv_heads, dim)
            out = attend(meta, layer.index, qk[:, :heads], qk[:, heads:], v, layer.scaling, window=layer.window)
            hidden = layer.o_module.fused_rows(out.reshape(num_tokens, heads * dim), residual=hidden)
            if layer.moe is not None:  # (over int4 experts one call: the norm, routing and sum routed_int4.cpp's)
                hidden = layer.moe.add_to(hidden, layer.post_norm)
                continue
            norm = layer.post_norm
            gate_up = layer.gate_up.fused.fused_rows(hidden, norm.weight, norm.eps)
            if layer.gate_up.fused.bias is not None:
                gate_up = gate_up + layer.gate_up.fused.bias
            gate, up = gate_up.split(layer.gate_up.sizes, dim=-1)  # silu(gate) * up: small_ops.cpp's, as the stack's
            act = self.small_ops[1](gate_up, gate.shape[1]) if layer.silu_mul else layer.act(gate) * up
            hidden = layer.down_module.fused_rows(act, residual=hidden)
        return hidden

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               keep: torch.Tensor) -> torch.Tensor:
        """The head's output `[len(keep), vocab]` at rows `keep` of the step."""
        if self.head_int4 is None:
            logits = self.head(self.hidden_states(input_ids, positions, meta)[keep])
            if self.final_softcap is not None:  # Gemma's final soft-capping, transformers' three operators
                logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
            return logits
        stream = self.hidden_states(input_ids, positions, meta, normed=False)[keep]
        return self.head_int4.fused_rows(stream, self.norm.weight, self.norm.eps)
