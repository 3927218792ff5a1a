"""The lean decoder's layer loop for a decode step on a GPU, in ponder's Triton kernels (runtime/kernels/gpu).

transformers' arithmetic with fewer launches: a layer is the RMS norm with the residual add before it,
the fused qkv matmul, the attention inputs (Qwen3's head norms, the rotary over queries and keys, the
KV write: one kernel), paged decode attention, the o matmul, the second norm with its add, the fused
gate/up matmul, SiLU * mul and the down matmul: nine launches, each row computed from its own inputs
only (the matmuls are torch's; row padding keeps their rows their own, as on every path). A layer
routed over experts whose blocks are stacked on the device (Qwen3-MoE's GGUF, runtime.model.gpu_experts)
takes the router's matmul, its routing (runtime/kernels/gpu/routed.py `route_rows`: softmax, top k,
renormalised, in ascending expert order) and the experts' two launches in place of the last three:
ten launches. Gemma 3
takes the same nine: its (1 + w) norms, the norm of each sublayer's output inside the launch that adds
it to the stream, GELU's tanh form, a rotary per layer type, and its sliding layers' KV in their own
cache where the runner keeps it apart (runtime.kv.window_split). The norms, rotary and activation
compute in float32 and round once where torch rounds twice, so a bfloat16 model's logits are close to
the torch loop's, not its bits; in float32 they agree to the last few bits (tested: the same tokens).

The matmuls are the layers' own: torch's for float weights, the Triton block GEMM for a GGUF's blocks
(runtime.model.gpu_blocks; the q, k and v of a mixed file, e.g. Q4_K beside Q6_K, one call each). A
down projection of blocks reads the gate/up output and computes SiLU(gate) * up (GELU's) as it loads
its inputs, the same bits as the elementwise launch: eight launches a layer. The
CPU's int4 layers (`decoder.int4`) are not of this loop.

A step runs here when the decode kernel attends every row of it (`covers`): no prompt prefilled by
SDPA, no residency hooks between layers, no head-wise attention, no recurrent layers. Others run the
torch loop (runtime.model.decoder), decided per step.
"""

from __future__ import annotations

import torch

from transformers.activations import GELUTanh

from runtime.kernels.gpu.elementwise import act_mul, rms_norm
from runtime.kernels.gpu.paged import attention_inputs, decode_attention
from runtime.kernels.gpu.routed import route_rows, routed_mlp
from runtime.model.attention import AttentionMetadata
from runtime.model.experts import SILU  # (both call F.silu: what the SiLU * mul kernel computes)
from runtime.model.gpu_blocks import GpuBlockLinear
from runtime.model.norms import OffsetRMSNorm, RMSNorm


class GpuLayers:
    """The decoder's layers as Triton kernel launches around torch's matmuls (see the module docstring)."""

    attention_kernel = staticmethod(decode_attention)

    def __init__(self, decoder) -> None:
        self.decoder = decoder
        self.layers = decoder.layers
        self.heads, self.kv_heads, self.head_dim = decoder.num_heads, decoder.num_kv_heads, decoder.head_dim
        self.offset = type(decoder.norm) is OffsetRMSNorm  # Gemma's norms (every norm of the model one kind)
        self.gelu = any(type(layer.act) is GELUTanh for layer in decoder.layers)
        # each layer's head norms' weights as the attention-inputs kernel reads them (q's, then k's)
        self.head_norms = [None if layer.q_norm is None else torch.stack((self._weight(layer.q_norm),
                                                                          self._weight(layer.k_norm)))
                           for layer in self.layers]
        # each dense layer's down projection where it is a GGUF's blocks (else None): it takes the gate/up output
        self.block_downs = [_block_layer(layer.down) if layer.moe is None else None for layer in self.layers]

    def _weight(self, norm) -> torch.Tensor:
        return norm.scale if self.offset else norm.weight

    @classmethod
    def build(cls, decoder) -> "GpuLayers | None":
        """None where a layer is not of the form the kernels compute: fused qkv and gate/up projections,
        SiLU or GELU's tanh form (gate, up), an even head size, every norm llama's RMS norm or every norm
        Gemma's (Qwen3's and Gemma's head norms of one eps; Gemma's norms of each sublayer's output)."""
        if decoder.head_dim % 2 or decoder.int4:
            return None
        offset = type(decoder.norm) is OffsetRMSNorm
        if type(decoder.norm) not in (RMSNorm, OffsetRMSNorm):
            return None
        dense = [layer for layer in decoder.layers if layer.moe is None]
        acts = {type(layer.act) for layer in dense}
        if not (acts <= set(SILU) or acts == {GELUTanh} and all(_c_gelu(layer.act) for layer in dense)):
            return None
        for layer in decoder.layers:
            if layer.qkv.fused_call is None:
                return None
            if layer.moe is not None:
                if routed_stacks(layer.moe) is None:
                    return None
            elif layer.gate_up.fused_call is None or len(layer.gate_up.sizes) != 2 or \
                    layer.gate_up.sizes[0] != layer.gate_up.sizes[1]:
                return None
            norms = [n for n in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm, layer.attn_out_norm,
                                 layer.mlp_out_norm) if n is not None]
            if any(type(norm) is not (OffsetRMSNorm if offset else RMSNorm) for norm in norms) or \
                    (layer.attn_out_norm is None) != (layer.mlp_out_norm is None) or \
                    (layer.attn_out_norm is not None and not offset) or layer.sinks is not None or \
                    (layer.q_norm is None) != (layer.k_norm is None) or \
                    (layer.q_norm is not None and layer.q_norm.eps != layer.k_norm.eps):
                return None
        return cls(decoder)

    @staticmethod
    def covers(meta: AttentionMetadata) -> bool:
        d = meta.decode_rows
        return d is not None and d.kernel is decode_attention and \
            not meta.decode_groups and not meta.prefills and meta.layers is None and meta.attention is None and \
            meta.recurrent is None and (meta.window is None or GpuLayers.covers(meta.window.meta))

    def __call__(self, hidden: torch.Tensor, rotations: dict, meta: AttentionMetadata,
                 normed: bool = True) -> torch.Tensor:
        """The final norm's output `[T, hidden]` (the residual stream before it with `normed=False`)
        for the embedded tokens `hidden`; `rotations` each layer rotary's (`layer.rope`) `cos`, `sin`
        `[T, 1, D]` as the decoder makes them."""
        num_tokens = hidden.shape[0]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        rotations = {kind: (cos.reshape(num_tokens, dim), sin.reshape(num_tokens, dim))
                     for kind, (cos, sin) in rotations.items()}
        offset = self.offset
        # the residual stream, what the last sublayer adds to it, and the norm of that before the add (Gemma's)
        stream, update, update_norm = hidden, None, None
        # (one buffer each a step: every layer's kernels write the same rows of them)
        queries = torch.empty((num_tokens, heads, dim), dtype=hidden.dtype, device=hidden.device)
        out = torch.zeros((num_tokens, heads, dim), dtype=hidden.dtype, device=hidden.device)
        for layer, norms, down in zip(self.layers, self.head_norms, self.block_downs):
            x, stream = self._norm(stream if update is None else update, layer.input_norm,
                                   None if update is None else stream, update_norm)
            cos, sin = rotations[layer.rope] if layer.rotary else (None, None)
            # (the layer's cache: a sliding layer's may be one of its own, runtime.kv.window_split)
            at, index = (meta, layer.index) if meta.window is None else meta.window.route(meta, layer.index, layer.window)
            cache, d = at.cache, at.decode_rows
            attention_inputs(layer.qkv.fused_call(x), heads, kv_heads, cos, sin, norms,
                             layer.q_norm.eps if norms is not None else 0.0, queries, cache.kv, cache.layer_rows,
                             index, at.slot_rows, offset=offset)
            scale = layer.scaling if layer.scaling is not None else dim ** -0.5
            decode_attention(queries, d.rows, cache.kv, d.tables, d.ctx, index, scale, out, window=layer.window or 0)
            attended = layer.o_proj(out.view(num_tokens, heads * dim))
            x, stream = self._norm(attended, layer.post_norm, stream, layer.attn_out_norm)
            if layer.moe is not None:  # (the router's matmul, its routing, then the experts: four launches)
                moe = layer.moe
                experts, weights = route_rows(moe.router_linear.rows(x), moe.top_k, moe.norm_topk_prob)
                update = routed_mlp(x, experts, weights, *moe.experts.stacks, ascending=True)
            elif down is not None:  # (a block layer computes act(gate) * up as it loads its inputs: one launch fewer)
                update = down.rows(layer.gate_up.fused_call(x), act=2 if self.gelu else 1)
            else:
                update = layer.down(act_mul(layer.gate_up.fused_call(x), layer.gate_up.sizes[0], gelu=self.gelu))
            update_norm = layer.mlp_out_norm
        x, stream = self._norm(update, self.decoder.norm, stream, update_norm)
        return x if normed else stream

    def _norm(self, x: torch.Tensor, norm, residual: torch.Tensor | None, pre) -> tuple[torch.Tensor, torch.Tensor]:
        """(`norm` of `pre(x) + residual`, that sum): one launch (`pre`: Gemma's norm of a sublayer's output)."""
        return rms_norm(x, self._weight(norm), norm.eps, residual=residual, offset=self.offset,
                        pre=None if pre is None else (pre.scale, pre.eps))


def _block_layer(call) -> GpuBlockLinear | None:
    """The block layer whose rows `call` computes (runtime.model.projections.rows_call's bound `rows`), or None."""
    layer = getattr(call, "__self__", None)
    return layer if isinstance(layer, GpuBlockLinear) else None


def routed_stacks(moe) -> tuple | None:
    """The stacked blocks a routed MLP block's experts run in the routed Triton kernels (runtime.model.gpu_experts),
    where its router is a kernel layer routing as Qwen3-MoE's (softmax over every expert, then the top k);
    else None."""
    stacks = getattr(moe.experts, "stacks", None)
    return stacks if moe.routing.softmax_first and not moe.routing.own and moe.router_linear is not None else None


def _c_gelu(act) -> bool:
    """Whether a GELUTanh computes torch's gelu(approximate="tanh") (not its Python formula)."""
    call = getattr(act, "act", None)
    return getattr(call, "func", None) is torch.nn.functional.gelu and call.keywords == {"approximate": "tanh"}
