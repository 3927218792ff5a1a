"""The lean decoder's layers as one call of ponder's CPU `int4_layers` kernel (runtime/kernels/csrc):
the stack a decode step runs where every layer is int4 (or float in ponder's float kernel) with SiLU,
its MLP dense or routed over experts (Qwen3-MoE's `RoutedMLP` over kernel experts and router)."""

from __future__ import annotations

import torch

from runtime.kernels.cpu_kernels import float_isa
from runtime.model.attention import AttentionMetadata
from runtime.model.block_embedding import embedding_dtype
from runtime.model.experts import SILU
from runtime.model.float_layers import FloatLinear
from runtime.model.quantize import Int4Linear, QuantizedLinear


class LayerStack:
    """`LeanDecoder._int4_layers` (or the float loop of `hidden_states` over ponder's float kernel) as
    one call of ponder's `int4_layers` kernel, for a step whose every row is attended by the decode
    kernel (`covers`): the same operators in the same order, so the same bits (tested), without the
    Python operator calls a layer otherwise costs. Built where every layer is int4 (or float in
    ponder's float kernel) with silu, its cache layer is its place in the stack, and the kernel loads;
    float layers with bfloat16 activations too (a bfloat16 model: the loop's roundings to bfloat16 kept).
    A routed MLP (runtime.model.experts.RoutedMLP over kernel experts and a kernel router) is in the
    stack too where `routed_takes` it: the router, its top-k and the experts' sum as RoutedMLP computes them."""

    def __init__(self, decoder, kernel) -> None:  # (a runtime.model.decoder.LeanDecoder)
        self.kernel = kernel
        self.dtype = embedding_dtype(decoder.embed)  # the activations' (float32, or bfloat16 with float layers)
        self.heads, self.kv_heads = decoder.num_heads, decoder.num_kv_heads
        empty = torch.empty(0)
        self.weights: list[torch.Tensor] = []
        self.sizes: list[int] = []
        self.floats: list[float] = []
        self.experts: list[torch.Tensor] = []  # a routed layer's experts, 6 tensors each (the kernel's order)
        for layer in decoder.layers:
            qkv, o = layer.qkv.fused, layer.o_module
            # the head norms' weights for one call over every head: q's for each query head, then k's
            head_norms = None if layer.q_norm is None else head_norm_weights(layer, self.heads, self.kv_heads)
            if layer.moe is None:
                gate_up, down = layer.gate_up.fused, layer.down_module
                mlp = (gate_up.weight, *scales(gate_up), gate_up.bias, down.weight, *scales(down))
                mlp_sizes = [gate_up.out_features, down.out_features, layer.gate_up.sizes[0], 0, 0]
            else:  # the router in the gate/up slots, an expert's sizes for all (`routed_takes`)
                moe, router = layer.moe, layer.moe.router_linear
                mlp = (router.weight, None, None, router.bias, None, None, None)
                gate_up, down = moe.modules[0]
                mlp_sizes = [gate_up.out_features, down.out_features, gate_up.out_features // 2, moe.top_k,
                             int(moe.norm_topk_prob)]
                if moe.int4_tensors is not None:  # (routed_int4.cpp's, the tensors RoutedMLP passes it)
                    self.experts += moe.int4_tensors
                else:  # float experts: their weights, no scales
                    self.experts += [empty if t is None else t.detach() for gate_up, down in moe.modules
                                     for t in (gate_up.weight, None, None, down.weight, None, None)]
            tensors = (layer.input_norm.weight, qkv.weight, *scales(qkv), qkv.bias, o.weight, *scales(o),
                       layer.post_norm.weight, *mlp, head_norms)
            self.weights += [empty if t is None else t.detach() for t in tensors]
            self.sizes += [qkv.out_features, o.out_features, *mlp_sizes[:3], int(layer.rotary), layer.window or 0,
                           *mlp_sizes[3:]]
            scale = layer.scaling if layer.scaling is not None else decoder.head_dim ** -0.5
            head_eps = 0.0 if layer.q_norm is None else layer.q_norm.eps
            self.floats += [layer.input_norm.eps, layer.post_norm.eps, scale, head_eps]

    @classmethod
    def build(cls, decoder) -> "LayerStack | None":
        from runtime.kernels.cpu_kernels import KernelUnavailable, layers_kernel

        dtype = embedding_dtype(decoder.embed)  # the activations'
        if any(layer.index != i or not (routed_takes(layer.moe) if layer.moe is not None else
                                         type(layer.act) in SILU and len(layer.gate_up.sizes) == 2
                                         and len(set(layer.gate_up.sizes)) == 1)
               or layer.input_norm.weight.dtype != dtype or layer.post_norm.weight.dtype != dtype
               or any(n is not None and n.weight.dtype != dtype for n in (layer.q_norm, layer.k_norm))
               or (layer.q_norm is not None and layer.q_norm.eps != layer.k_norm.eps)
               for i, layer in enumerate(decoder.layers)):
            return None
        try:
            return cls(decoder, layers_kernel())
        except KernelUnavailable:
            return None

    def covers(self, meta: AttentionMetadata) -> bool:
        """True when every row of the step is attended by the decode kernel, no residency mode needs
        to run between layers, and the cache holds the activations' dtype."""
        return meta.decode_rows is not None and not meta.decode_groups and not meta.prefills and \
            meta.layers is None and meta.cache.dtype == self.dtype

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, d = hidden.shape[0], meta.decode_rows
        # (a bfloat16 model's cos and sin widened exactly: the kernel rounds as the loop does)
        cos, sin = cos.reshape(num_tokens, -1).float().contiguous(), sin.reshape(num_tokens, -1).float().contiguous()
        return self.kernel(hidden, cos, sin,
                           self.weights, self.sizes, self.floats, self.experts, self.heads, self.kv_heads, meta.cache.kv,
                           meta.slot_rows.contiguous(), d.rows, d.tables, d.ctx, float_isa())


def routed_takes(moe) -> bool:  # (a runtime.model.experts.RoutedMLP)
    """Whether the kernel computes a routed block: a float-kernel router without a bias, SiLU, every
    expert's gate/up and down in one kind of kernel layer without a bias, all of one size; int4 experts
    where RoutedMLP runs them in one call of routed_int4.cpp (the op the kernel calls), float ones where
    their routing is transformers' (the ATen operators the kernel repeats)."""
    router = moe.router_linear
    if not isinstance(router, FloatLinear) or router.bias is not None or type(moe.act) not in SILU or \
            len(moe.modules) != router.out_features:
        return False
    if not (moe.int4_tensors is not None or moe.all_kernel(FloatLinear) and moe.routing.softmax_first
            and not moe.routing.own):
        return False
    shapes = {(g.out_features, g.in_features, d.out_features, d.in_features) for g, d in moe.modules}
    if len(shapes) != 1:
        return False
    (gate_up, hidden, down, inner), = shapes
    return 0 < moe.top_k <= len(moe.modules) and hidden == down == router.in_features and gate_up == 2 * inner


def head_norm_weights(layer, heads: int, kv_heads: int) -> torch.Tensor:
    """A layer's q and k norms' weights for one call over every head `[heads + kv_heads, D]`: q's for
    each query head, then k's for each KV head."""
    return torch.cat([layer.q_norm.weight.detach().expand(heads, -1), layer.k_norm.weight.detach().expand(kv_heads, -1)])


def scales(layer: QuantizedLinear) -> tuple:
    """An int4 layer's (d, m) for the stack kernel; a float layer has none."""
    return (layer.d, layer.m) if isinstance(layer, Int4Linear) else (None, None)
