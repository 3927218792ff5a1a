"""The lean decoder's layer loop for a decode step on a GPU, in ponder's Triton kernels (runtime/kernels/gpu).

transformers' arithmetic with fewer launches: a layer is the RMS norm with the residual add before it,
the fused qkv matmul, the attention inputs (Qwen3's head norms, the rotary over queries and keys, the
KV write: one kernel), paged decode attention, the o matmul, the second norm with its add, the fused
gate/up matmul, SiLU * mul and the down matmul: nine launches, each row computed from its own inputs
only (the matmuls are torch's; row padding keeps their rows their own, as on every path). The norms,
rotary and activation compute in float32 and round once where torch rounds twice, so a bfloat16
model's logits are close to the torch loop's, not its bits; in float32 they agree to the last few bits
(tested: the same tokens).

The matmuls are the layers' own: torch's for float weights, the Triton block GEMM for a GGUF's blocks
(runtime.model.gpu_blocks; the q, k and v of a mixed file, e.g. Q4_K beside Q6_K, one call each). The
CPU's int4 layers (`decoder.int4`) are not of this loop.

A step runs here when the decode kernel attends every row of it (`covers`): no prompt prefilled by
SDPA, no residency hooks between layers, no head-wise attention, no recurrent layers. Others run the
torch loop (runtime.model.decoder), decided per step.
"""

from __future__ import annotations

import torch

from runtime.kernels.gpu.elementwise import rms_norm, silu_mul
from runtime.kernels.gpu.paged import attention_inputs, decode_attention
from runtime.model.attention import AttentionMetadata
from runtime.model.experts import SILU  # (both call F.silu: what the SiLU * mul kernel computes)
from runtime.model.norms import RMSNorm


class GpuLayers:
    """The decoder's layers as Triton kernel launches around torch's matmuls (see the module docstring)."""

    attention_kernel = staticmethod(decode_attention)

    def __init__(self, decoder) -> None:
        self.decoder = decoder
        self.layers = decoder.layers
        self.heads, self.kv_heads, self.head_dim = decoder.num_heads, decoder.num_kv_heads, decoder.head_dim
        # each layer's head norms' weights as the attention-inputs kernel reads them (q's, then k's)
        self.head_norms = [None if layer.q_norm is None else torch.stack((layer.q_norm.weight, layer.k_norm.weight))
                           for layer in self.layers]

    @classmethod
    def build(cls, decoder) -> "GpuLayers | None":
        """None where a layer is not of the form the kernels compute: fused qkv and gate/up projections,
        SiLU (gate, up), an even head size, RMS norms (Qwen3's head norms of one eps)."""
        if decoder.head_dim % 2 or decoder.int4:
            return None
        for layer in decoder.layers:
            if layer.qkv.fused_call is None or layer.gate_up.fused_call is None or len(layer.gate_up.sizes) != 2 \
                    or layer.gate_up.sizes[0] != layer.gate_up.sizes[1] or type(layer.act) not in SILU:
                return None
            norms = (layer.input_norm, layer.post_norm) + ((layer.q_norm, layer.k_norm) if layer.q_norm else ())
            if any(type(norm) is not RMSNorm for norm in norms) or layer.attn_out_norm or layer.mlp_out_norm or \
                    layer.sinks is not None or (layer.q_norm is not None and layer.q_norm.eps != layer.k_norm.eps):
                return None
        return cls(decoder)

    @staticmethod
    def covers(meta: AttentionMetadata) -> bool:
        d = meta.decode_rows
        return d is not None and d.kernel is decode_attention and \
            not meta.decode_groups and not meta.prefills and meta.layers is None and meta.attention is None and \
            meta.recurrent is None

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 normed: bool = True) -> torch.Tensor:
        """The final norm's output `[T, hidden]` (the residual stream before it with `normed=False`)
        for the embedded tokens `hidden`; `cos`, `sin` `[T, 1, D]` as the decoder makes them."""
        num_tokens = hidden.shape[0]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        cos, sin = cos.reshape(num_tokens, dim), sin.reshape(num_tokens, dim)
        cache, d = meta.cache, meta.decode_rows
        stream, update = hidden, None  # the residual stream, and what the last sublayer adds to it
        # (one buffer each a step: every layer's kernels write the same rows of them)
        queries = torch.empty((num_tokens, heads, dim), dtype=hidden.dtype, device=hidden.device)
        out = torch.zeros((num_tokens, heads, dim), dtype=hidden.dtype, device=hidden.device)
        for layer, norms in zip(self.layers, self.head_norms):
            x, stream = rms_norm(stream if update is None else update, layer.input_norm.weight, layer.input_norm.eps,
                                 residual=None if update is None else stream)
            attention_inputs(layer.qkv.fused_call(x), heads, kv_heads, cos if layer.rotary else None,
                             sin if layer.rotary else None, norms, layer.q_norm.eps if norms is not None else 0.0,
                             queries, cache.kv, cache.layer_rows, layer.index, meta.slot_rows)
            scale = layer.scaling if layer.scaling is not None else dim ** -0.5
            decode_attention(queries, d.rows, cache.kv, d.tables, d.ctx, layer.index, scale, out, window=layer.window or 0)
            attended = layer.o_proj(out.view(num_tokens, heads * dim))
            x, stream = rms_norm(attended, layer.post_norm.weight, layer.post_norm.eps, residual=stream)
            update = layer.down(silu_mul(layer.gate_up.fused_call(x), layer.gate_up.sizes[0]))
        final = self.decoder.norm
        x, stream = rms_norm(update, final.weight, final.eps, residual=stream)
        return x if normed else stream
