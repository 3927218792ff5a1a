"""Qwen3.5's text model (`qwen3_5_text`) in the lean decoder: transformers' arithmetic, operator for operator
in the same order and dtypes, without its module calls, its projections fused.

A Qwen3.5 layer is a Gated DeltaNet (linear-attention) layer or a gated full-attention layer, each
followed by llama's MLP, with (1 + w) RMS norms (runtime.model.norms.OffsetRMSNorm) before both:

- full attention (`_AttentionLayer`): q_proj gives each head's query and its output gate side by side
  (`[q(D), gate(D)]` a head); q, k and v are one fused projection; per-head (1 + w) norms on queries and
  keys, then the rotary over the first `rotary_dim` features of each head only (partial rotary, its
  interleaved mrope sections as transformers' rotary module computes cos and sin: that module is called
  once a step), ponder's paged attention, the output times sigmoid(gate), o_proj;
- Gated DeltaNet (`_DeltaLayer`): in_proj_qkv, in_proj_z, in_proj_b and in_proj_a are one fused
  projection where their layers are of one kind (a GGUF's of different block types: one fused layer a
  run of one type, never widened), the causal convolution and the gated delta rule over each sequence's
  recurrent state are the layer's `DeltaRule` (runtime.model.recurrent, the code transformers' forward
  runs there too), then the gated RMS norm with z (`GatedNorm`) and out_proj.

Every kernel a projection may run in computes an output column from its own weights only, so fusing
keeps each output's bits (runtime.model.decoder), and the logits are transformers' forward's bits
(tested, float32 and bfloat16, under each `quantize`). A step is the Python loop over the layers, or,
where every projection is an int4 kernel layer and every row of the step the decode kernel's, one call
of the stack kernel that runs the int4 loop's operators (runtime.model.hybrid_stack, the same bits).
Qwen3.5-MoE (`qwen3_5_moe_text`) has the same layers, each MLP a sparse
block (runtime.model.shared_experts: the routed experts beside a gated shared one) on the post-attention
norm's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.model.attention import AttentionMetadata, attend
from runtime.model.block_embedding import embedding_dtype
from runtime.model.float_layers import FloatLinear
from runtime.model.decoder import Projections, rows_call
from runtime.model.hybrid_stack import HybridStack
from runtime.model.norms import Norm, OffsetRMSNorm, norm_of
from runtime.model.quantize import INT4_BLOCK_COLUMNS, Int4Linear
from runtime.model.recurrent import DeltaRule, delta_rules
from runtime.model.shared_experts import SharedExpertMoE

HYBRID_ARCHITECTURES = ("qwen3_5_text", "qwen3_5_moe_text")  # (runtime.model.decoders builds this decoder for them)
_DELTA_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
DELTA_LAYERS = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")  # (one class's code, under two names)
_NARROW = 16


@dataclass
class GatedNorm:
    """Qwen3_5RMSNormGated: x normed in float32, rounded to its dtype, times the weight, times silu(gate)
    in float32, rounded to x's dtype."""

    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        h = h * F.silu(gate.to(torch.float32))
        return h.to(dtype)


@dataclass
class KernelOps:
    """The int4 loop's small operators in ponder's own arithmetic, the hybrid stack kernel's (runtime/kernels/csrc)."""

    silu_mul: object
    gated_norm: object
    qk_heads: object
    sigmoid_gate: object

    @classmethod
    def load(cls) -> "KernelOps":
        from runtime.kernels.cpu_kernels import hybrid_ops, small_ops

        return cls(small_ops()[1], *hybrid_ops())


def _format(layer: nn.Module):
    """What two layers must share for one fused layer to hold both without widening either."""
    if isinstance(layer, Int4Linear):
        return Int4Linear, layer.m is None, layer.bits, layer.d.dtype, tuple(layer.d.shape[1:])
    return type(layer), getattr(layer, "bias", None) is None


def _continues(run: list[nn.Module], layer: nn.Module) -> bool:
    """Whether `layer` can join `run` in one fused layer: one format; an int kernel layer's columns fill
    its last block of `INT4_BLOCK_COLUMNS` (only a fused layer's last may leave it part empty); and where
    torch computes them (nn.Linear, int8), neither layer is narrower than `_NARROW` columns: torch's
    matmul takes another path for so narrow an output (in_proj_b's and in_proj_a's, one a value head),
    whose bits a wider one's columns do not keep (tested)."""
    last = run[-1]
    if _format(last) != _format(layer) or (isinstance(last, Int4Linear) and last.out_features % INT4_BLOCK_COLUMNS):
        return False
    return isinstance(layer, (Int4Linear, FloatLinear)) or min(last.out_features, layer.out_features) >= _NARROW


class RunProjections:
    """Linear layers reading one input: one fused layer for each run of consecutive layers that can be
    fused (`_continues`), their outputs in the layers' order. (A Q4_K_M file's in_proj_qkv is Q8_0 beside
    a Q5_0 in_proj_z: one fused layer would widen the Q5_0 codes to 8 bits, reading more bytes.)"""

    def __init__(self, layers: list[nn.Module]) -> None:
        runs: list[list[nn.Module]] = []
        for layer in layers:
            if runs and _continues(runs[-1], layer):
                runs[-1].append(layer)
            else:
                runs.append([layer])
        self.runs = [Projections(run) for run in runs]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(self.runs) == 1:
            return self.runs[0](x)
        return tuple(out for run in self.runs for out in run(x))


class _MLP:
    """Llama's MLP over the post-attention norm, and the residual add after it. With `int4` (set by the
    decoder where every projection is an int4 kernel layer and the activations float32) the norm runs in
    the kernel call of the projection after it and the residual add in the call before it, as
    runtime.model.decoder's int4 loop does (the kernel's arithmetic: logits close to transformers', not
    its bits)."""

    int4 = False
    ops: "KernelOps | None" = None  # (the int4 loop's own small operators, set with `int4`)

    def __init__(self, layer: nn.Module) -> None:
        mlp = layer.mlp
        self.post_norm = norm_of(layer.post_attention_layernorm)
        # Qwen3.5-MoE's sparse block (runtime.model.shared_experts), on the normed rows in torch's norm
        self.moe = SharedExpertMoE(mlp) if SharedExpertMoE.takes(mlp) else None
        if self.moe is not None:
            self.gate_up = self.moe.gate_up  # (the shared expert's: runtime.model.row_padding probes `gate_up`)
            return
        self.gate_up = Projections([mlp.gate_proj, mlp.up_proj])
        self.act = mlp.act_fn
        self.down_module = mlp.down_proj
        self.down = rows_call(mlp.down_proj)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.moe is not None:
            return hidden + self.moe(self.post_norm(hidden))
        if self.int4:  # (silu(gate) * up in ponder's own arithmetic: small_ops.cpp's, as the stack kernel's)
            norm = self.post_norm
            gate_up = self.gate_up.fused.fused_rows(hidden, norm.scale, norm.eps)
            return self.down_module.fused_rows(self.ops.silu_mul(gate_up, self.gate_up.sizes[0]), residual=hidden)
        gate, up = self.gate_up(self.post_norm(hidden))
        return hidden + self.down(self.act(gate) * up)

    def kernel_layers(self) -> list[nn.Module]:
        """The layers the int4 path calls `fused_rows` of (a sparse block's: none)."""
        return [] if self.moe is not None else [self.gate_up.fused, self.down_module]


class _AttentionLayer(_MLP):
    def __init__(self, layer: nn.Module, config) -> None:
        super().__init__(layer)
        attn = layer.self_attn
        self.index, self.scaling = attn.layer_idx, attn.scaling
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
        self.input_norm = norm_of(layer.input_layernorm)
        self.qkv = Projections([attn.q_proj, attn.k_proj, attn.v_proj])
        self.q_norm, self.k_norm = norm_of(attn.q_norm), norm_of(attn.k_norm)
        self.o_module = attn.o_proj
        self.o_proj = rows_call(attn.o_proj)

    def kernel_layers(self) -> list[nn.Module]:
        return [self.qkv.fused, self.o_module, *super().kernel_layers()]

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        tokens, heads, kv_heads, dim = hidden.shape[0], self.heads, self.kv_heads, self.head_dim
        if self.int4:  # the head norms, rotary and output gate in ponder's own arithmetic (hybrid_ops.cpp)
            norm, q_norm, k_norm = self.input_norm, self.q_norm, self.k_norm
            qkv = self.qkv.fused.fused_rows(hidden, norm.scale, norm.eps)
            qk = self.ops.qk_heads(qkv, heads, kv_heads, dim, q_norm.scale, k_norm.scale, q_norm.eps, k_norm.eps, cos, sin)
            value = qkv[:, (2 * heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
            out = attend(meta, self.index, qk[:, :heads], qk[:, heads:], value, self.scaling)
            out = self.ops.sigmoid_gate(out.view(tokens, heads * dim), qkv, heads, dim)
            return super().__call__(self.o_module.fused_rows(out, residual=hidden))
        query_gate, key, value = self.qkv(self.input_norm(hidden))
        query_gate = query_gate.view(tokens, heads, 2 * dim)
        gate = query_gate[..., dim:].reshape(tokens, heads * dim)
        qk = torch.cat((self.q_norm(query_gate[..., :dim]), self.k_norm(key.view(tokens, kv_heads, dim))), dim=1)
        # the rotary over each head's first `rotary_dim` features, queries and keys in one pass
        rotary = cos.shape[-1]
        turned = qk[..., :rotary]
        turned = (turned * cos) + (torch.roll(turned, rotary // 2, dims=-1) * sin)
        qk = torch.cat((turned, qk[..., rotary:]), dim=-1)
        out = attend(meta, self.index, qk[:, :heads], qk[:, heads:], value.view(tokens, kv_heads, dim), self.scaling)
        out = out.reshape(tokens, heads * dim) * torch.sigmoid(gate)
        return super().__call__(hidden + self.o_proj(out))


class _DeltaLayer(_MLP):
    def __init__(self, layer: nn.Module, rule: DeltaRule) -> None:
        super().__init__(layer)
        attn = layer.linear_attn
        self.rule = rule
        self.head_v_dim = attn.head_v_dim
        self.input_norm = norm_of(layer.input_layernorm)
        self.in_proj = RunProjections([getattr(attn, name) for name in _DELTA_PROJECTIONS])
        self.qkv = self.in_proj.runs[0]  # (runtime.model.row_padding probes a layer's `qkv` and `gate_up`)
        self.norm = GatedNorm(attn.norm.weight, attn.norm.variance_epsilon)
        self.out_proj = rows_call(attn.out_proj)
        # (a tiled GGUF's out_proj reads its input in the file's column order: runtime.model.gguf_qwen35.InputOrder)
        self.out_module = getattr(attn.out_proj, "layer", attn.out_proj)
        self.out_order = getattr(attn.out_proj, "order", None)

    def kernel_layers(self) -> list[nn.Module]:
        return [*(run.fused for run in self.in_proj.runs), self.out_module, *super().kernel_layers()]

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        tokens, width = hidden.shape[0], self.head_v_dim
        if self.int4:
            norm = self.input_norm
            mixed, z, b, a = (out for run in self.in_proj.runs
                              for out in run.fused.fused_rows(hidden, norm.scale, norm.eps).split(run.sizes, dim=-1))
        else:
            mixed, z, b, a = self.in_proj(self.input_norm(hidden))
        core = self.rule(meta.recurrent, mixed, a, b)
        if not self.int4:
            out = self.norm(core.to(hidden.dtype).reshape(-1, width), z.reshape(-1, width)).reshape(tokens, -1)
            return super().__call__(hidden + self.out_proj(out))
        out = self.ops.gated_norm(core.view(-1, width), z, self.norm.weight, self.norm.eps)  # (hybrid_ops.cpp's)
        if self.out_order is not None:
            out = out.index_select(-1, self.out_order)
        return super().__call__(self.out_module.fused_rows(out, residual=hidden))


class HybridDecoder:
    """The lean decoder's Qwen3.5 (see the module docstring): runtime.model.decoder.LeanDecoder's interface
    (`hidden_states`, `logits`), its GPU-loop part absent and its stack kernel runtime.model.hybrid_stack's."""

    gpu = None  # (no Triton loop)
    floats = kernel_form = False

    def __init__(self, model: nn.Module) -> None:
        base, config = model.base_model, model.config
        self.embed, self.rotary, self.head = base.embed_tokens, base.rotary_emb, model.lm_head
        self.norm: Norm = norm_of(base.norm)
        rules = iter(delta_rules(model))
        self.layers = [_DeltaLayer(layer, next(rules)) if hasattr(layer, "linear_attn") else _AttentionLayer(layer, config)
                       for layer in base.layers[:config.num_hidden_layers]]
        # int4 kernel layers throughout (a GGUF's blocks, `quantize = "int4"`) and float32 activations: the
        # norms and residual adds in the kernel calls (`_MLP`)
        self.int4 = embedding_dtype(self.embed) == torch.float32 and all(
            isinstance(module, Int4Linear) and module.bias is None
            for layer in self.layers for module in layer.kernel_layers())
        ops = KernelOps.load() if self.int4 else None
        for layer in self.layers:
            layer.int4, layer.ops = self.int4, ops
        # the int4 loop as one kernel call where every row of a step is the decode kernel's (runtime.model.hybrid_stack)
        self.stack = HybridStack.build(self) if self.int4 else None

    @classmethod
    def build(cls, model: nn.Module) -> "HybridDecoder | None":
        """The decoder, or None where a part of the model is not of the form above."""
        config, base = model.config, getattr(model, "base_model", None)
        if config.model_type not in HYBRID_ARCHITECTURES or base is None or \
                not all(hasattr(base, n) for n in ("embed_tokens", "rotary_emb", "norm", "layers")) or \
                not isinstance(norm_of(base.norm), OffsetRMSNorm) or not isinstance(getattr(model, "lm_head", None), nn.Module):
            return None
        for layer in base.layers[:config.num_hidden_layers]:
            mlp = getattr(layer, "mlp", None)
            if mlp is None or not (SharedExpertMoE.takes(mlp) or
                                   all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))):
                return None
            if not all(isinstance(norm_of(getattr(layer, n, None)), OffsetRMSNorm)
                       for n in ("input_layernorm", "post_attention_layernorm")):
                return None
            if hasattr(layer, "linear_attn"):
                attn = layer.linear_attn
                if type(attn).__name__ not in DELTA_LAYERS or \
                        not all(hasattr(attn, n) for n in (*_DELTA_PROJECTIONS, "norm", "out_proj")):
                    return None
                continue
            attn = getattr(layer, "self_attn", None)
            if attn is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm",
                                                                  "k_norm", "layer_idx", "scaling", "head_dim")):
                return None
            if attn.q_proj.out_features != 2 * config.num_attention_heads * attn.head_dim or \
                    not isinstance(norm_of(attn.q_norm), OffsetRMSNorm) or not isinstance(norm_of(attn.k_norm), OffsetRMSNorm):
                return None  # (the gated output: queries and gates side by side)
        return cls(model)

    def use_gpu_layers(self) -> bool:
        return False

    def rotation(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) `[T, 1, rotary_dim]` from transformers' rotary module, sin's first half negated (the
        rotation is then x * cos + x rolled by rotary_dim / 2 * sin: runtime.model.decoder's same bits)."""
        cos, sin = self.rotary(hidden, positions)
        half = cos.shape[-1] // 2
        return cos[0, :, None], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)[:, None]

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata, normed: bool = True) -> torch.Tensor:
        """The final norm's output `[T, hidden]` for `input_ids` `[1, T]` at `positions` `[1, T]`
        (the residual stream before it with `normed=False`)."""
        if meta.recurrent is None:
            raise RuntimeError("Qwen3.5's linear-attention layers need the step's recurrent segments")
        hidden = self.embed(input_ids[0])
        cos, sin = self.rotation(hidden, positions)
        if self.stack is not None and self.stack.covers(meta):
            hidden = self.stack(hidden, cos, sin, meta)
            return self.norm(hidden) if normed else hidden
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, meta)
        return self.norm(hidden) if normed else hidden

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               keep: torch.Tensor) -> torch.Tensor:
        """The head's output `[len(keep), vocab]` at rows `keep` of the step."""
        return self.head(self.hidden_states(input_ids, positions, meta)[keep])
