"""Routed experts (Qwen3-MoE's sparse MLP) in the lean decoder and in ponder's kernels.

transformers holds a layer's experts as two stacked parameters (`Qwen3MoeExperts.gate_up_proj`
`[experts, 2 * intermediate, hidden]`, `down_proj` `[experts, hidden, intermediate]`) and a router
(`Qwen3MoeTopKRouter.weight` `[experts, hidden]`). Its reference loop (`experts_implementation =
"eager"`) computes, for each expert hit in ascending order, the rows routed to it as one matmul
(entries in (top-k position, token) order), scales them by their routing weight and adds them into
zeros with `index_add_`.

`RoutedMLP` runs that arithmetic in the lean decoder with one sort of the step's (token, expert)
entries instead of a mask per expert, so a step pays for each expert hit once, whatever its batch:

- over transformers' own parameters (`quantize = "none"`), with torch's matmuls: the reference loop's
  bits (tested), but a row's bits depend on how many rows share its expert (the routed-experts refusal
  of runtime.model.row_padding stands);
- over `KernelExperts` (one ponder kernel layer per expert's gate/up and down: `FloatLinear` for a
  float model, `Int4Linear` for `quantize = "int4"`) and a `KernelRouter` (the router in ponder's
  float kernel): every output row comes from its own input row only, and a token's experts are added
  in ascending expert order into zeros, so a row's bits never depend on the batch. Such a model holds
  no stacked parameter, and batch invariance is served (tested: the same row alone and in a crowd).

`hold_experts(model, mode)` replaces the stacked modules by the kernel ones (their `forward` is
transformers' signature, so transformers' forward still runs them).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from runtime.model.float_layers import FloatLinear, narrowest, takes_weight
from runtime.model.quantize import INT4_GROUP_SIZE, Int4Linear, Quantized, QuantizedLinear

# The transformers classes whose routing `RoutedMLP` computes: softmax over every expert in float32,
# top-k, the k weights renormalised where `norm_topk_prob`, then cast to the logits' dtype.
SOFTMAX_TOPK_ROUTERS = ("Qwen3MoeTopKRouter",)
STACKED_EXPERTS = ("Qwen3MoeExperts",)


class KernelRouter(nn.Module):
    """A softmax-top-k router whose logits come from `linear` (a ponder kernel layer); `forward` returns
    transformers' (logits, weights, indices)."""

    def __init__(self, linear: QuantizedLinear, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.linear, self.top_k, self.norm_topk_prob = linear, top_k, norm_topk_prob
        self.num_experts, self.hidden_dim = linear.out_features, linear.in_features

    def forward(self, hidden_states: torch.Tensor):
        logits = self.linear.rows(hidden_states.reshape(-1, self.hidden_dim))
        return (logits, *route(logits, self.top_k, self.norm_topk_prob))


class KernelExperts(nn.Module):
    """A layer's experts as one ponder kernel layer each: `gate_up[e]` (gate then up, side by side) and
    `down[e]`; `forward` is transformers' experts' (hidden, top-k indices, top-k weights)."""

    def __init__(self, gate_up: list[QuantizedLinear], down: list[QuantizedLinear], act_fn: nn.Module) -> None:
        super().__init__()
        self.gate_up, self.down, self.act_fn = nn.ModuleList(gate_up), nn.ModuleList(down), act_fn
        self.num_experts = len(gate_up)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        calls = [(g.rows, d.rows) for g, d in zip(self.gate_up, self.down)]
        return mix_experts(hidden_states, top_k_index, top_k_weights, calls, self.act_fn)


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, indices) `[rows, top_k]` as transformers' Qwen3MoeTopKRouter computes them from `logits`."""
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top, indices = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top /= top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), indices


def mix_experts(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, calls: list,
                act: nn.Module) -> torch.Tensor:
    """Sum over each row's experts of weight * down(act(gate) * up), rows grouped by expert: one call
    of each expert hit, on its rows in (top-k position, token) order (transformers' `torch.where`
    order), the experts added in ascending order into zeros, as transformers' reference loop does
    (the same float additions as its `index_add_`)."""
    num_tokens, top_k = indices.shape
    flat = indices.t().reshape(-1)  # entry p * T + t: token t's p-th expert
    order = torch.argsort(flat, stable=True)
    tokens = order % num_tokens
    entry_weights = weights.t().reshape(-1)[order, None]
    counts = torch.bincount(flat, minlength=len(calls)).tolist()
    gathered = x[tokens]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        end = start + count
        gate_up, down = calls[expert]
        gate, up = gate_up(gathered[start:end]).chunk(2, dim=-1)
        h = down(act(gate) * up) * entry_weights[start:end]
        # index_add_'s out[t] + h, as an indexed read and write: an expert's tokens are distinct, and
        # torch's deterministic index_add_ on a CPU (batch invariance sets it) costs milliseconds a call
        rows = tokens[start:end]
        out[rows] = out[rows] + h.to(out.dtype)
        start = end
    return out


class RoutedMLP:
    """A sparse MLP block's computation on normed rows `[T, hidden]` (see the module docstring)."""

    def __init__(self, mlp: nn.Module) -> None:
        router, experts = mlp.gate, mlp.experts
        self.top_k, self.norm_topk_prob = router.top_k, router.norm_topk_prob
        self.act = experts.act_fn
        # the router's kernel layer (None: transformers' weight in torch's matmul)
        self.router_linear = router.linear if isinstance(router, KernelRouter) else None
        if isinstance(router, KernelRouter):
            self.router = router.linear.rows
        else:
            weight = router.weight
            self.router = lambda x: F.linear(x, weight)
        if isinstance(experts, KernelExperts):
            self.modules = list(zip(experts.gate_up, experts.down))
            self.calls = [(g.rows, d.rows) for g, d in self.modules]
        else:
            self.modules = []
            self.calls = [(lambda x, w=experts.gate_up_proj[e]: F.linear(x, w),
                           lambda x, w=experts.down_proj[e]: F.linear(x, w)) for e in range(experts.num_experts)]

    @staticmethod
    def takes(mlp: nn.Module) -> bool:
        router, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
        return (isinstance(router, KernelRouter) or type(router).__name__ in SOFTMAX_TOPK_ROUTERS) and \
            (isinstance(experts, KernelExperts) or type(experts).__name__ in STACKED_EXPERTS) and \
            not getattr(experts, "has_bias", False) and getattr(experts, "is_concatenated", True) and \
            not getattr(experts, "is_transposed", False)

    def all_kernel(self, kind: type) -> bool:
        """Whether every expert's layers are `kind` without a bias (the router may be float)."""
        return bool(self.modules) and all(isinstance(l, kind) and l.bias is None for pair in self.modules for l in pair)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = route(self.router(x), self.top_k, self.norm_topk_prob)
        return mix_experts(x, indices, weights, self.calls, self.act)


@torch.no_grad()
def hold_experts(model: nn.Module, mode: str) -> int:
    """Replace every stacked-experts block's router and experts by kernel ones: `mode` "int4" (experts
    in Int4Linear, the router in ponder's float kernel) or "float" (both in ponder's float kernel).
    Returns how many experts' layers were replaced; a block a kernel cannot take is left as it is."""
    held = 0
    for module in list(model.modules()):
        if not RoutedMLP.takes(module) or isinstance(module.experts, KernelExperts):
            continue
        router, experts = module.gate, module.experts
        hidden = router.weight.shape[1]
        if not takes_weight(router.weight) or (mode == "int4" and (hidden % INT4_GROUP_SIZE
                                                                   or experts.down_proj.shape[2] % INT4_GROUP_SIZE)):
            continue
        if mode == "int4":
            make = Int4Linear.from_weight
        else:
            if not takes_weight(experts.down_proj):
                continue
            make = lambda w: FloatLinear.from_weight(narrowest(w.detach()))  # noqa: E731
        gate_up = [make(experts.gate_up_proj[e]) for e in range(experts.num_experts)]
        down = [make(experts.down_proj[e]) for e in range(experts.num_experts)]
        module.experts = KernelExperts(gate_up, down, experts.act_fn)
        module.gate = KernelRouter(FloatLinear.from_weight(narrowest(router.weight.detach())), router.top_k,
                                   router.norm_topk_prob)
        held += 2 * experts.num_experts
    return held


def with_routed_experts(model: nn.Module, quantized: Quantized) -> Quantized:
    """After the linear layers became int4 or float kernel layers (`quantized`), the routed experts'
    stacked weights become kernel layers too, one an expert (`hold_experts`); what the setting became
    then counts and names them."""
    if quantized.mode not in ("int4", "float"):
        return quantized
    held = hold_experts(model, quantized.mode)
    if not held:
        return quantized
    return replace(quantized, layers=quantized.layers + held,
                   detail=f"{quantized.detail}; {held} routed experts' layers in ponder's kernels")
