"""Routed experts (Qwen3-MoE's and gpt-oss's sparse MLPs) in the lean decoder and in ponder's kernels.

transformers holds a layer's experts as two stacked parameters and a router:
- Qwen3-MoE: `Qwen3MoeExperts.gate_up_proj` `[experts, 2 * intermediate, hidden]` (the gate's rows,
  then the up projection's), `down_proj` `[experts, hidden, intermediate]`, no bias, SiLU(gate) * up;
  `Qwen3MoeTopKRouter` (`gate`): softmax over every expert in float32, top-k, renormalised where
  `norm_topk_prob`;
- gpt-oss: `GptOssExperts.gate_up_proj` `[experts, hidden, 2 * intermediate]` (transposed, gate and
  up columns interleaved), `down_proj` `[experts, intermediate, hidden]`, each with a bias, computed as
  `x @ w + b`, and the clamped SwiGLU (`ClampedSwiGLU`); `GptOssTopKRouter` (`router`, with a bias):
  top-k of the logits, then a softmax over those k in the logits' dtype.
Its reference loop (`experts_implementation = "eager"`) computes, for each expert hit in ascending
order, the rows routed to it as one matmul (entries in (top-k position, token) order), scales them by
their routing weight and adds them into zeros with `index_add_`.

`RoutedMLP` runs that arithmetic in the lean decoder with one sort of the step's (token, expert)
entries instead of a mask per expert, so a step pays for each expert hit once, whatever its batch:

- over transformers' own parameters (`quantize = "none"`), with torch's matmuls: the reference loop's
  bits (tested), but a row's bits depend on how many rows share its expert (the routed-experts refusal
  of runtime.model.row_padding stands);
- over `KernelExperts` (one ponder kernel layer per expert's gate/up and down: `FloatLinear` for a
  float model, `Int4Linear` for `quantize = "int4"` and a GGUF's blocks) and a `KernelRouter` (the
  router in ponder's float kernel): every output row comes from its own input row only, and a token's
  experts are added in ascending expert order into zeros, so a row's bits never depend on the batch.
  Such a model holds no stacked parameter, and batch invariance is served (tested: the same row alone
  and in a crowd). Float experts run the operators above through ATen; int4 experts with SiLU(gate) * up
  (Qwen3-MoE's) and a softmax-first router run the block in ponder's own fixed-order arithmetic
  (runtime/kernels/csrc/routed_int4.cpp: `KernelRouter`'s routing is its `route_rows`, `KernelExperts`'
  sum its `mix_int4`, `RoutedMLP` the whole block in one call, with the norm before and the residual
  after in the int4 loop), the functions the stack kernel calls: one set of bits, without ATen's
  operators in the layer.

`hold_experts(model, mode)` replaces the stacked modules by the kernel ones (their `forward` is
transformers' signature, so transformers' forward still runs them); a gpt-oss expert's layers keep
their biases and the interleaved order of the gate's and up's outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from transformers.activations import SiLUActivation

from runtime.kernels.cpu_kernels import float_isa, routed_ops
from runtime.model.float_layers import FloatLinear, narrowest, takes_weight
from runtime.model.quantize import INT4_GROUP_SIZE, Int4Linear, Quantized, QuantizedLinear

# The transformers classes whose routing `RoutedMLP` computes: softmax over every expert in float32,
# top-k, the k weights renormalised where `norm_topk_prob`, then cast to the logits' dtype.
SOFTMAX_TOPK_ROUTERS = ("Qwen3MoeTopKRouter", "Qwen3_5MoeTopKRouter")
STACKED_EXPERTS = ("Qwen3MoeExperts", "Qwen3_5MoeExperts")
# Qwen3.5-MoE's router renormalises its k weights always (it has no `norm_topk_prob`)
ALWAYS_RENORMALISED = ("Qwen3_5MoeTopKRouter",)
# gpt-oss's: top-k of the (biased) logits, softmax over the k; its experts transposed, biased, clamped SwiGLU
TOPK_SOFTMAX_ROUTERS = ("GptOssTopKRouter",)
BIASED_EXPERTS = ("GptOssExperts",)
SILU = (nn.SiLU, SiLUActivation)  # both call F.silu: the activation routed_int4.cpp (and the stack kernel) computes


@dataclass(frozen=True)
class Routing:
    """How a router's logits `[rows, experts]` become (weights, indices) `[rows, top_k]`: Qwen3-MoE's
    softmax then top-k (`softmax_first`), or gpt-oss's top-k then softmax over the k."""

    top_k: int
    norm_topk_prob: bool = False
    softmax_first: bool = True
    # softmax first in ponder's own arithmetic (routed_int4.cpp's `route_rows`: float32 logits), the
    # routing of int4 experts (`int4_routing`)
    own: bool = False

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.own:  # (in float32; the weights in the logits' dtype, as transformers' router gives them)
            weights, indices = routed_ops()[1](logits.float().contiguous(), self.top_k, self.norm_topk_prob)
            return weights.to(logits.dtype), indices
        if self.softmax_first:
            return route(logits, self.top_k, self.norm_topk_prob)
        top, indices = torch.topk(logits, self.top_k, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), indices


@dataclass(frozen=True)
class SiluGLU:
    """act(gate) * up, the gate's outputs first (Qwen3-MoE's experts)."""

    act: nn.Module

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's `GptOssExperts._apply_gate`, operator for operator: gate and up interleaved (gate at even
    columns), gate clamped from above and up on both sides at `limit`, (up + 1) * gate * sigmoid(gate * alpha)."""

    alpha: float
    limit: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class KernelRouter(nn.Module):
    """A router whose logits come from `linear` (a ponder kernel layer, with the router's bias if it has
    one), routed by softmax then top-k (or by `routing`); `forward` returns transformers' (logits,
    weights, indices)."""

    def __init__(self, linear: QuantizedLinear, top_k: int, norm_topk_prob: bool, routing: Routing | None = None) -> None:
        super().__init__()
        self.routing = routing or Routing(top_k, norm_topk_prob)
        self.linear, self.top_k, self.norm_topk_prob = linear, top_k, norm_topk_prob
        self.num_experts, self.hidden_dim = linear.out_features, linear.in_features

    def forward(self, hidden_states: torch.Tensor):
        logits = self.linear.rows(hidden_states.reshape(-1, self.hidden_dim))
        return (logits, *self.routing(logits))


class KernelExperts(nn.Module):
    """A layer's experts as one ponder kernel layer each: `gate_up[e]` (gate then up, side by side; or as
    `glu` reads them) and `down[e]`; `forward` is transformers' experts' (hidden, top-k indices, top-k weights)."""

    def __init__(self, gate_up: list[QuantizedLinear], down: list[QuantizedLinear], act_fn: nn.Module | None,
                 glu=None) -> None:
        super().__init__()
        self.gate_up, self.down, self.act_fn = nn.ModuleList(gate_up), nn.ModuleList(down), act_fn
        self.glu = glu or SiluGLU(act_fn)
        self.num_experts = len(gate_up)
        # int4 experts with SiLU(gate) * up: their 6 tensors each for routed_int4.cpp (None: the ATen loop)
        self.tensors = int4_tensors(self.gate_up, self.down) if isinstance(self.glu, SiluGLU) and \
            type(self.glu.act) in SILU else None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.tensors is not None:  # (float32 rows, as the int4 kernel's; the sum back in the rows' dtype)
            return routed_ops()[2](hidden_states.float(), top_k_index, top_k_weights.float(), self.tensors,
                                   self.gate_up[0].out_features, self.down[0].out_features).to(hidden_states.dtype)
        calls = [(g.rows, d.rows) for g, d in zip(self.gate_up, self.down)]
        return mix_experts(hidden_states, top_k_index, top_k_weights, calls, self.glu)


def int4_tensors(gate_up: list, down: list) -> list[torch.Tensor] | None:
    """Every expert's (gate/up codes, d, m, down codes, d, m) (m empty where absent) for routed_int4.cpp,
    where every layer is an Int4Linear without a bias, all of one shape and the gate's half of gate/up
    the down's input; else None."""
    layers = [*gate_up, *down]
    if not layers or not all(isinstance(l, Int4Linear) and l.bias is None for l in layers) or \
            len({(g.out_features, g.in_features, d.out_features, d.in_features) for g, d in zip(gate_up, down)}) != 1 \
            or gate_up[0].out_features != 2 * down[0].in_features or gate_up[0].in_features != down[0].out_features:
        return None
    empty = torch.empty(0)
    return [empty if t is None else t.detach() for g, d in zip(gate_up, down)
            for t in (g.weight, g.d, g.m, d.weight, d.d, d.m)]


def int4_routing(routing: Routing, experts: KernelExperts) -> Routing:
    """`routing` in ponder's own arithmetic where it is softmax first and `experts` run routed_int4.cpp's
    sum: the router and the experts then compute what RoutedMLP's one call computes."""
    return replace(routing, own=routing.softmax_first and experts.tensors is not None)


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, indices) `[rows, top_k]` as transformers' Qwen3MoeTopKRouter computes them from `logits`."""
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top, indices = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top /= top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), indices


def mix_experts(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, calls: list, glu) -> torch.Tensor:
    """Sum over each row's experts of weight * down(glu(gate_up(row))), rows grouped by expert: one call
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
        h = down(glu(gate_up(gathered[start:end]))) * entry_weights[start:end]
        # index_add_'s out[t] + h, as an indexed read and write: an expert's tokens are distinct, and
        # torch's deterministic index_add_ on a CPU (batch invariance sets it) costs milliseconds a call
        rows = tokens[start:end]
        out[rows] = out[rows] + h.to(out.dtype)
        start = end
    return out


class RoutedMLP:
    """A sparse MLP block's computation on normed rows `[T, hidden]` (see the module docstring)."""

    def __init__(self, mlp: nn.Module) -> None:
        _, router = router_of(mlp)
        experts = mlp.experts
        self.routing = routing_of(router)
        self.top_k, self.norm_topk_prob = self.routing.top_k, self.routing.norm_topk_prob
        # SiLU where the experts compute SiLU(gate) * up (the stack kernel's), else None (gpt-oss's `glu`)
        self.act = experts.act_fn if isinstance(getattr(experts, "act_fn", None), nn.Module) else None
        self.glu = experts.glu if isinstance(experts, KernelExperts) else glu_of(experts)
        # the router's kernel layer (None: transformers' weight in torch's matmul)
        self.router_linear = router.linear if isinstance(router, KernelRouter) else None
        if isinstance(router, KernelRouter):
            self.router = router.linear.rows
        else:
            weight, bias = router.weight, getattr(router, "bias", None)
            self.router = lambda x: F.linear(x, weight, bias)
        self.experts = experts
        if isinstance(experts, KernelExperts):
            self.modules = list(zip(experts.gate_up, experts.down))
            self.mix = experts.forward
        else:
            self.modules = []
            calls = [stacked_calls(experts, e) for e in range(experts.num_experts)]
            self.mix = lambda x, indices, weights: mix_experts(x, indices, weights, calls, self.glu)
        # the whole block in one call of routed_int4.cpp (routing and experts in its arithmetic), with
        # the experts' tensors for it and the stack kernel; None: routing, then `mix`
        own = isinstance(experts, KernelExperts) and self.routing.own and experts.tensors is not None and \
            self.router_linear is not None and self.router_linear.bias is None
        self.int4_tensors = experts.tensors if own else None

    @staticmethod
    def takes(mlp: nn.Module) -> bool:
        _, router = router_of(mlp)
        experts = getattr(mlp, "experts", None)
        if isinstance(router, KernelRouter) and isinstance(experts, KernelExperts):
            return True
        if type(router).__name__ in SOFTMAX_TOPK_ROUTERS:
            return type(experts).__name__ in STACKED_EXPERTS and not getattr(experts, "has_bias", False) and \
                getattr(experts, "is_concatenated", True) and not getattr(experts, "is_transposed", False)
        return type(router).__name__ in TOPK_SOFTMAX_ROUTERS and type(experts).__name__ in BIASED_EXPERTS and \
            getattr(experts, "has_bias", False) and not getattr(experts, "is_concatenated", True) and \
            getattr(experts, "is_transposed", False)

    def all_kernel(self, kind: type) -> bool:
        """Whether every expert's layers are `kind` without a bias (the router may be float)."""
        return bool(self.modules) and all(isinstance(l, kind) and l.bias is None for pair in self.modules for l in pair)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4_tensors is not None and x.dtype == torch.float32:
            return self._block(x, None, 0.0, False)
        weights, indices = self.routing(self.router(x))
        return self.mix(x, indices, weights)

    def add_to(self, hidden: torch.Tensor, norm) -> torch.Tensor:
        """hidden + self(norm(hidden)) for the post-attention norm `norm` (runtime.model.decoder's `_Norm`);
        over int4 experts in one call, the norm routed_int4.cpp's own (as the stack kernel computes it)."""
        if self.int4_tensors is not None and hidden.dtype == torch.float32 == norm.weight.dtype:
            return self._block(hidden, norm.weight, norm.eps, True)
        return hidden + self(norm(hidden))

    def _block(self, x: torch.Tensor, norm_weight, eps: float, residual: bool) -> torch.Tensor:
        gate_up, down = self.modules[0]
        return routed_ops()[0](x, norm_weight, eps, self.router_linear.weight, self.int4_tensors, self.top_k,
                               self.norm_topk_prob, gate_up.out_features, down.out_features, float_isa(), residual)


def router_of(mlp: nn.Module) -> tuple[str, nn.Module | None]:
    """(the attribute, the router) of a sparse MLP block: Qwen3-MoE's `gate`, gpt-oss's `router`."""
    for name in ("gate", "router"):
        router = getattr(mlp, name, None)
        if isinstance(router, KernelRouter) or type(router).__name__ in SOFTMAX_TOPK_ROUTERS + TOPK_SOFTMAX_ROUTERS:
            return name, router
    return "gate", None


def routing_of(router: nn.Module) -> Routing:
    """How `router` (a kernel one, or one of transformers' classes `RoutedMLP` takes) routes its logits."""
    if isinstance(router, KernelRouter):
        return router.routing
    return Routing(router.top_k, renormalises(router), softmax_first=type(router).__name__ in SOFTMAX_TOPK_ROUTERS)


def renormalises(router: nn.Module) -> bool:
    """Whether one of transformers' softmax-first routers divides its top-k weights by their sum."""
    return getattr(router, "norm_topk_prob", type(router).__name__ in ALWAYS_RENORMALISED)


def glu_of(experts: nn.Module):
    """What transformers' stacked `experts` compute between an expert's gate/up and its down."""
    if type(experts).__name__ in BIASED_EXPERTS:
        return ClampedSwiGLU(experts.alpha, experts.limit)
    return SiluGLU(experts.act_fn)


def stacked_calls(experts: nn.Module, e: int) -> tuple:
    """Expert `e`'s (gate/up, down) over transformers' stacked parameters, as its reference loop computes
    them: Qwen3-MoE's `F.linear(x, w)`; gpt-oss's `x @ w + b` (its weights transposed, its bias added
    after the matmul)."""
    if type(experts).__name__ in BIASED_EXPERTS:
        return (lambda x, w=experts.gate_up_proj[e], b=experts.gate_up_proj_bias[e]: x @ w + b,
                lambda x, w=experts.down_proj[e], b=experts.down_proj_bias[e]: x @ w + b)
    return (lambda x, w=experts.gate_up_proj[e]: F.linear(x, w),
            lambda x, w=experts.down_proj[e]: F.linear(x, w))


def expert_layers(experts: nn.Module, e: int) -> tuple:
    """Expert `e`'s (gate/up weight `[2I, hidden]`, its bias, down weight `[hidden, I]`, its bias) from
    transformers' stacked parameters, in their output order (gpt-oss's gate and up stay interleaved)."""
    if type(experts).__name__ in BIASED_EXPERTS:
        return (experts.gate_up_proj[e].t().contiguous(), experts.gate_up_proj_bias[e].detach(),
                experts.down_proj[e].t().contiguous(), experts.down_proj_bias[e].detach())
    return experts.gate_up_proj[e], None, experts.down_proj[e], None


@torch.no_grad()
def hold_experts(model: nn.Module, mode: str) -> int:
    """Replace every stacked-experts block's router and experts by kernel ones: `mode` "int4" (experts
    in Int4Linear, the router in ponder's float kernel) or "float" (both in ponder's float kernel).
    Returns how many experts' layers were replaced; a block a kernel cannot take is left as it is."""
    held = 0
    for module in list(model.modules()):
        if not RoutedMLP.takes(module) or isinstance(module.experts, KernelExperts):
            continue
        name, router = router_of(module)
        experts = module.experts
        layers = [expert_layers(experts, e) for e in range(experts.num_experts)]
        hidden, inner = router.weight.shape[1], layers[0][2].shape[1]
        if not takes_weight(router.weight) or (mode == "int4" and (hidden % INT4_GROUP_SIZE or inner % INT4_GROUP_SIZE)):
            continue
        if mode == "int4":
            make = Int4Linear.from_weight
        else:
            if not takes_weight(layers[0][2]):
                continue
            make = lambda w, b: FloatLinear.from_weight(narrowest(w.detach()), b)  # noqa: E731
        gate_up = [make(gate_up, gate_up_bias) for gate_up, gate_up_bias, _, _ in layers]
        down = [make(down, down_bias) for _, _, down, down_bias in layers]
        glu = glu_of(experts)
        module.experts = KernelExperts(gate_up, down, glu.act if isinstance(glu, SiluGLU) else None, glu)
        routing = int4_routing(routing_of(router), module.experts)
        bias = getattr(router, "bias", None)
        setattr(module, name, KernelRouter(FloatLinear.from_weight(narrowest(router.weight.detach()),
                                                                   None if bias is None else bias.detach()),
                                           routing.top_k, routing.norm_topk_prob, routing))
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
