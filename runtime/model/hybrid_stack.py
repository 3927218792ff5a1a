"""Qwen3.5's int4 layers as one call of ponder's CPU `hybrid_layers` kernel (runtime/kernels/csrc): the
stack a decode step runs where every projection of runtime.model.qwen35_layers' HybridDecoder is an
int4 kernel layer, its activations float32 and every MLP llama's with SiLU. The kernel runs the same
operators in the same order on tensors of the same shapes as the decoder's int4 loop, so the same bits
(tested), without the Python calls a layer otherwise costs; the Gated DeltaNet layers' recurrent states
are resumed and recorded by their `DeltaRule`s (runtime.model.recurrent), as the loop's are."""

from __future__ import annotations

import torch

from runtime.model.attention import AttentionMetadata
from runtime.model.experts import SILU
from runtime.model.norms import OffsetRMSNorm
from runtime.model.quantize import Int4Linear
from runtime.model.recurrent import kernel_ends

_RUNS = 4  # in-projection layers a layer may have (a delta layer's four projections, each its own run)


class HybridStack:
    """`HybridDecoder`'s int4 loop (runtime.model.qwen35_layers) as one call of the `hybrid_layers` kernel,
    for a step whose every row is attended by the decode kernel (`covers`)."""

    def __init__(self, decoder, kernel) -> None:  # (a runtime.model.qwen35_layers.HybridDecoder)
        self.kernel = kernel
        empty = torch.empty(0)
        self.weights: list[torch.Tensor] = []
        self.sizes: list[int] = []
        self.floats: list[float] = []
        self.rules = [layer.rule for layer in decoder.layers if hasattr(layer, "rule")]
        attention = next(layer for layer in decoder.layers if not hasattr(layer, "rule"))
        first = self.rules[0].layer
        self.dims = [attention.heads, attention.kv_heads, attention.head_dim,
                     first.num_k_heads, first.head_k_dim, first.num_v_heads, first.head_v_dim]
        for layer in decoder.layers:
            delta = hasattr(layer, "rule")
            runs = [run.fused for run in layer.in_proj.runs] if delta else [layer.qkv.fused]
            runs += [None] * (_RUNS - len(runs))
            out = layer.out_module if delta else layer.o_module
            gate_up, down = layer.gate_up.fused, layer.down_module
            if delta:
                rule = layer.rule
                extra = (layer.norm.weight, layer.out_order, rule.taps, rule.kernel_bias, rule.dt_bias, rule.a_log)
                third = layer.norm.eps
                heads = (0.0, 0.0)
            else:
                extra = (layer.q_norm.scale, layer.k_norm.scale, None, None, None, None)
                third = layer.scaling if layer.scaling is not None else layer.head_dim ** -0.5
                heads = (layer.q_norm.eps, layer.k_norm.eps)
            tensors = (layer.input_norm.scale, *(t for run in runs for t in _codes(run)), *_codes(out),
                       layer.post_norm.scale, *_codes(gate_up), *_codes(down), *extra)
            self.weights += [empty if t is None else t.detach().contiguous() for t in tensors]
            self.sizes += [0 if delta else 1, *(0 if run is None else run.out_features for run in runs),
                           out.out_features, gate_up.out_features, down.out_features, layer.gate_up.sizes[0],
                           0 if delta else layer.index]
            self.floats += [layer.input_norm.eps, layer.post_norm.eps, third, *heads]

    @classmethod
    def build(cls, decoder) -> "HybridStack | None":
        """The stack, or None where a layer is not of the form above or the kernel cannot run."""
        from runtime.kernels.cpu_kernels import KernelUnavailable, hybrid_layers_kernel

        if not decoder.int4 or not all(_takes(layer) for layer in decoder.layers):
            return None
        rules = [layer.rule for layer in decoder.layers if hasattr(layer, "rule")]
        attention = [layer for layer in decoder.layers if not hasattr(layer, "rule")]
        if not rules or not attention or len({(r.layer.num_k_heads, r.layer.head_k_dim, r.layer.num_v_heads,
                                                r.layer.head_v_dim) for r in rules}) != 1 or \
                len({(a.heads, a.kv_heads, a.head_dim) for a in attention}) != 1:
            return None
        try:
            return cls(decoder, hybrid_layers_kernel())
        except KernelUnavailable:
            return None

    def covers(self, meta: AttentionMetadata) -> bool:
        """True when every row of the step is attended by the decode kernel in the one float32 cache, and
        no residency mode runs between layers."""
        shape = meta.cache.shape
        return meta.decode_rows is not None and not meta.decode_groups and not meta.prefills and \
            meta.layers is None and meta.attention is None and meta.window is None and meta.recurrent is not None \
            and meta.cache.dtype == torch.float32 and (shape.num_kv_heads, shape.head_dim) == tuple(self.dims[1:3])

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        step, d = meta.recurrent, meta.decode_rows
        initial = [rule.initial(step, hidden.device) for rule in self.rules]
        counts = step.snapshot_counts()
        segments = step.segments
        out = self.kernel(hidden, cos, sin, self.weights, self.sizes, self.floats, self.dims, meta.cache.kv,
                          meta.slot_rows.contiguous(), d.rows, d.tables, d.ctx,
                          [conv for states in initial for conv, _ in states],
                          [state for states in initial for _, state in states],
                          [s.row for s in segments], [s.length for s in segments], [c for cs in counts for c in cs],
                          [len(cs) for cs in counts])
        at, per_layer = 1, 1 + 2 * len(segments) + sum(len(cs) for cs in counts)
        for rule, states in zip(self.rules, initial):
            rule.record(step, out[at], states, kernel_ends(out[at + 1:at + per_layer], counts))
            at += per_layer
        return out[0]


def _codes(layer: Int4Linear | None) -> tuple:
    return (None, None, None) if layer is None else (layer.weight, layer.d, layer.m)


def _takes(layer) -> bool:
    """Whether the kernel computes the layer: int4 projections without biases (the decoder's `int4`),
    llama's MLP with SiLU, a delta layer's rule in ponder's kernel, (1 + w) head norms."""
    if layer.moe is not None or type(layer.act) not in SILU or len(layer.gate_up.sizes) != 2 or \
            len(set(layer.gate_up.sizes)) != 1:
        return False
    if hasattr(layer, "rule"):
        return layer.rule.kernel is not None and len(layer.in_proj.runs) <= _RUNS and \
            all(isinstance(run.fused, Int4Linear) for run in layer.in_proj.runs)
    return isinstance(layer.q_norm, OffsetRMSNorm) and isinstance(layer.k_norm, OffsetRMSNorm)
