"""Gated DeltaNet layers (Qwen3.5 dense and MoE, Qwen3-Next) over ponder's recurrent states (storage.recurrent_state).

transformers' linear-attention layer keeps a convolution window and a recurrent matrix per sequence in
its own cache object, which ponder's flattened step (every scheduled sequence's new tokens in one row)
does not pass: without them each step would start from nothing. `RecurrentLayers` replaces each such
layer's forward with `gated_delta_forward`, which runs transformers' arithmetic sequence by sequence
from the state the sequence resumes (`RecurrentStep`), and records the states each sequence ends with
(and at each block boundary it passes) once the step is over. Past the projections that is a layer's
`DeltaRule`, which the lean decoder's Qwen3.5 layers (runtime.model.qwen35_layers) call too.

Every token is computed by the recurrent form, token after token: a state after token t is then one
function of the tokens before it, whatever the steps were cut into, whatever else ran beside it, and
whether the prompt came from the prefix cache, so seeds hold (the chunked form's bits depend on where
a chunk starts). Past the projections each sequence is computed from its own inputs and state only,
one token at a time (the torch loop on tensors of one token's shape, sequence after sequence; ponder's
CPU kernel every sequence of the step in one call a layer, one parallel region over (sequence, value
head): no per-sequence call or tensor, which cost a decode step more than the arithmetic), so a
sequence's bits do not depend on the batch (tested: seeded sampling alone, with its prompt cached and
in a crowd; the kernel's sequences in one call against each alone).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from storage.recurrent_state import RecurrentStates, Resume, State, prefix_keys

# transformers' classes whose forward is replaced, with the projections each reads its inputs with.
LAYER_CLASSES = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet")
SNAPSHOT_BYTES = 256 << 20  # a reward model's block-boundary states kept for resuming (its own store)


def recurrent_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in LAYER_CLASSES]


@dataclass
class Segment:
    """One sequence's rows of the step: tokens `begin .. end - 1` at rows `row .. row + end - begin - 1`,
    continuing `resume` (begin is its token count)."""

    seq_id: int
    token_ids: Seq[int]
    row: int
    begin: int
    end: int
    resume: Resume

    @property
    def length(self) -> int:
        return self.end - self.begin


@dataclass
class RecurrentStep:
    """The step's segments, and each segment's new states as the layers make them."""

    segments: list[Segment]
    block_size: int
    # per segment: per layer, (final conv, final recurrent) and {boundary: (conv, recurrent)}
    finals: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    boundaries: list[list[dict[int, tuple[torch.Tensor, torch.Tensor]]]] = field(default_factory=list)
    _counts: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.finals = [[] for _ in self.segments]
        self.boundaries = [[] for _ in self.segments]

    def snapshot_counts(self) -> list[list[int]]:
        """Per segment, its new tokens' counts at the block boundaries it passes (`boundary_positions`
        less its `begin`): where each layer's recurrent state is kept as a snapshot; made once a step."""
        if self._counts is None:
            self._counts = [[p - s.begin for p in self.boundary_positions(s)] for s in self.segments]
        return self._counts

    def boundary_positions(self, segment: Segment) -> list[int]:
        """Token counts at block boundaries the segment passes (its end included when it is one)."""
        first = -(-(segment.begin + 1) // self.block_size) * self.block_size
        return list(range(first, segment.end + 1, self.block_size))


class RecurrentLayers:
    """The model's Gated DeltaNet layers, run over `states`."""

    def __init__(self, layers: list[nn.Module], states: RecurrentStates) -> None:
        self.layers = layers
        self.states = states
        self.kernel = kernel = _kernel_for(layers[0])  # None: the token loop in torch
        self.rules = [DeltaRule(layer, index, kernel) for index, layer in enumerate(layers)]
        for layer, rule in zip(layers, self.rules):
            layer.forward = partial(gated_delta_forward, rule)

    @classmethod
    def build(cls, model: nn.Module, states: RecurrentStates | None) -> "RecurrentLayers | None":
        layers = recurrent_layers(model) if model is not None else []  # None: a runner of attention alone (tests)
        if not layers:
            return None
        if states is None:
            raise ValueError("a model with recurrent layers needs RecurrentStates beside its KV")
        return cls(layers, states)

    def resume(self, seq_id: int, token_ids: Seq[int], start: int) -> Resume:
        return self.states.resume(seq_id, token_ids, start)

    def finish(self, step: RecurrentStep) -> None:
        """Keep each segment's final state as its sequence's, and its block-boundary states as snapshots."""
        for segment, finals, boundaries in zip(step.segments, step.finals, step.boundaries):
            if len(finals) != len(self.layers):  # the forward did not reach every layer
                continue
            keys, key = prefix_keys(segment.token_ids, step.block_size, segment.end)
            self.states.store(segment.seq_id, State(segment.end, key, _flat(finals)))
            for position in step.boundary_positions(segment):
                per_layer = [layer[position] for layer in boundaries]
                self.states.snapshot(State(position, keys[position // step.block_size - 1], _flat(per_layer)))


def recurrent_states(model: nn.Module, block_size: int, snapshot_bytes: int = SNAPSHOT_BYTES) -> RecurrentStates | None:
    """The states a model's recurrent layers need beside its paged KV (with at most `snapshot_bytes` of
    block-boundary snapshots, `cache.recurrent_snapshot_gib`), or None when it has none."""
    return RecurrentStates(block_size, snapshot_bytes) if recurrent_layers(model) else None


def delta_rules(model: nn.Module) -> list["DeltaRule"]:
    """A `DeltaRule` for each of the model's recurrent layers, in their order (the lean decoder's)."""
    layers = recurrent_layers(model)
    kernel = _kernel_for(layers[0]) if layers else None
    return [DeltaRule(layer, index, kernel) for index, layer in enumerate(layers)]


def _kernel_for(layer: nn.Module):
    """ponder's CPU kernel (runtime/kernels/csrc/gated_delta.cpp) for a float32 layer on a CPU, its Triton
    twin (runtime/kernels/gpu/gated_delta.py) for a layer on a CUDA device, else None (the token loop
    below, in torch)."""
    from runtime.kernels.cpu_kernels import KernelUnavailable, gated_delta_steps_kernel
    from runtime.kernels.gpu import runs_on

    weight = layer.conv1d.weight
    if runs_on(weight.device) and layer.head_k_dim & (layer.head_k_dim - 1) == 0:
        from runtime.kernels.gpu.gated_delta import gated_delta_steps

        return gated_delta_steps
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    try:
        return gated_delta_steps_kernel()
    except KernelUnavailable:
        return None


def _flat(per_layer: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    return tuple(t for pair in per_layer for t in pair)


def _initial(layer: nn.Module, index: int, resume: Resume, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the inputs of the last `kernel - 1` tokens `[K-1, conv_dim]`, the recurrent state `[Hv, dk, dv]`)."""
    if resume.state is not None:
        return resume.state.tensors[2 * index], resume.state.tensors[2 * index + 1]
    conv = torch.zeros(layer.conv_kernel_size - 1, layer.conv_dim, device=device, dtype=layer.conv1d.weight.dtype)
    recurrent = torch.zeros(layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, device=device, dtype=torch.float32)
    return conv, recurrent


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _projections(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(the convolution's inputs `[T, conv_dim]`, the gate `z` `[T, Hv, dv]`, `b` and `a` `[T, Hv]`) as
    each family's layer projects them: Qwen3.5's four projections, or Qwen3-Next's two, grouped by key head."""
    if hasattr(layer, "in_proj_qkvz"):
        query, key, value, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x[None]), layer.in_proj_ba(x[None]))
        mixed = torch.cat([t.reshape(1, x.shape[0], -1) for t in (query, key, value)], dim=-1)
        return mixed[0], z[0], b[0], a[0]
    z = layer.in_proj_z(x).reshape(x.shape[0], -1, layer.head_v_dim)
    return layer.in_proj_qkv(x), z, layer.in_proj_b(x), layer.in_proj_a(x)


class DeltaRule:
    """One Gated DeltaNet layer past its projections: the causal convolution and the gated delta rule
    over each segment of a step from the state it resumes (`__call__`), its constants read once.
    transformers' forward (`gated_delta_forward`) and the lean decoder (runtime.model.qwen35_layers) both
    call it; `index` is the layer's place among the model's recurrent layers (its tensors' in a `State`)."""

    def __init__(self, layer: nn.Module, index: int, kernel) -> None:
        self.layer, self.index, self.kernel = layer, index, kernel
        weight = layer.conv1d.weight.detach()
        self.taps = weight.squeeze(1).transpose(0, 1).contiguous()  # [K, conv_dim]
        self.width = layer.conv_kernel_size
        self.num_v_heads, self.head_v_dim = layer.num_v_heads, layer.head_v_dim
        if kernel is not None:  # the kernel's float32 inputs, made once
            bias = layer.conv1d.bias
            self.kernel_taps = self.taps.float().contiguous()
            self.kernel_bias = bias.detach().float() if bias is not None else self.kernel_taps.new_empty(0)
            self.dt_bias = layer.dt_bias.detach().float().contiguous()
            self.a_log = layer.A_log.detach().float().contiguous()

    def __call__(self, step: "RecurrentStep", mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The delta rule's output `[T, Hv, dv]` (float32) for the step's rows from the convolution's inputs
        `mixed` `[T, conv_dim]` and `a`, `b` `[T, Hv]`; each segment's new states are recorded in `step`.

        The rest runs token by token on tensors of one token's shape, so no elementwise function (exp,
        sigmoid, softplus, silu: a vector kernel and its scalar tail round differently) sees a token at a
        place in a tensor that depends on the other tokens of the step. ponder's kernel runs every
        segment in one call (one parallel region over (segment, value head)); the torch loop, segment
        after segment."""
        layer = self.layer
        core = torch.zeros(mixed.shape[0], self.num_v_heads, self.head_v_dim, dtype=torch.float32, device=mixed.device)
        initial = self.initial(step, mixed.device)
        counts = step.snapshot_counts()
        if self.kernel is None:
            ends = [_in_torch(layer, segment, self._window(mixed, segment, conv), self.taps, a, b, state, taken, core,
                              mixed.dtype)
                    for segment, (conv, state), taken in zip(step.segments, initial, counts)]
        else:
            ends = self._in_kernel(step, mixed, a, b, initial, counts, core)
        self.record(step, mixed, initial, ends)
        return core

    def initial(self, step: "RecurrentStep", device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each segment's (last K-1 convolution inputs, recurrent state) it resumes this layer from."""
        return [_initial(self.layer, self.index, segment.resume, device) for segment in step.segments]

    def record(self, step: "RecurrentStep", mixed: torch.Tensor, initial: list, ends: list[tuple]) -> None:
        """Record in `step` each segment's new states from `ends` (per segment: its last K-1 convolution
        inputs, its final state, its states at its snapshot counts), its block-boundary windows from
        `mixed` (the convolution's inputs `[T, conv_dim]`)."""
        width, counts = self.width, step.snapshot_counts()
        for number, (segment, (conv, final, taken)) in enumerate(zip(step.segments, ends)):
            step.finals[number].append((conv, final))
            window = self._window(mixed, segment, initial[number][0]) if counts[number] else None
            step.boundaries[number].append({segment.begin + c: (window[c:c + width - 1].clone(), s)
                                            for c, s in zip(counts[number], taken)})

    def _window(self, mixed: torch.Tensor, segment: "Segment", conv_state: torch.Tensor) -> torch.Tensor:
        """`[K-1+n, C]`: the convolution's inputs of the segment's tokens begin-K+1 .. end-1."""
        rows = mixed[segment.row:segment.row + segment.length].to(self.taps.dtype)
        return torch.cat([conv_state, rows])

    def _in_kernel(self, step: "RecurrentStep", mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   initial: list, counts: list[list[int]], core: torch.Tensor) -> list[tuple]:
        """Every segment through ponder's kernel in one call: per segment (its last K-1 convolution inputs,
        its final recurrent state, its state after each of its `counts`), its outputs written into `core`."""
        layer, segments = self.layer, step.segments
        out = self.kernel(mixed.float(), self.kernel_taps, self.kernel_bias, a.float(), b.float(), self.dt_bias, self.a_log,
                          [conv for conv, _ in initial], [state for _, state in initial],
                          [s.row for s in segments], [s.length for s in segments], [c for cs in counts for c in cs],
                          [len(cs) for cs in counts], layer.num_k_heads, layer.head_k_dim, layer.head_v_dim, core)
        return kernel_ends(out, counts)


def kernel_ends(out: Seq[torch.Tensor], counts: list[list[int]]) -> list[tuple]:
    """The kernel's outputs (per segment: its last K-1 convolution inputs, its final state, then its
    states at its `counts`) as one tuple a segment, as `DeltaRule.record` takes them."""
    ends, at = [], 0
    for taken in counts:
        ends.append((out[at], out[at + 1], out[at + 2:at + 2 + len(taken)]))
        at += 2 + len(taken)
    return ends


def gated_delta_forward(rule: DeltaRule, hidden_states: torch.Tensor, cache=None, attention_mask=None,
                        **kwargs) -> torch.Tensor:
    """transformers' Gated DeltaNet forward (its recurrent form) for every segment of the step, each from
    its own state; `hidden_states` is the step's row `[1, T, hidden]` (rows in no segment: padding).

    The projections run over the whole row (the runner's row padding keeps their rows their own); the
    rest is `rule`'s."""
    step: RecurrentStep = kwargs["ponder_attention"].recurrent
    layer = rule.layer
    x = hidden_states[0]
    mixed, z, b, a = _projections(layer, x)
    core = rule(step, mixed, a, b)
    out = layer.norm(core.to(x.dtype).reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(out.reshape(x.shape[0], -1))[None]


def _in_torch(layer: nn.Module, segment: Segment, window: torch.Tensor, taps: torch.Tensor, a: torch.Tensor,
              b: torch.Tensor, state: torch.Tensor, counts: list[int], core: torch.Tensor, dtype) -> tuple:
    """One segment in torch, token by token on one token's shapes (see `DeltaRule.__call__`), its outputs
    written into `core`: (its last K-1 convolution inputs, its final state, its state after each of `counts` tokens)."""
    bias, width = layer.conv1d.bias, layer.conv_kernel_size
    decay_rate = -layer.A_log.float().exp()
    repeat = layer.num_v_heads // layer.num_k_heads
    taken = []
    for t in range(segment.length):
        row = segment.row + t
        conv = window[t] * taps[0]
        for tap in range(1, width):
            conv = conv + window[t + tap] * taps[tap]
        if bias is not None:
            conv = conv + bias
        conv = F.silu(conv).to(dtype)
        q, k, v = torch.split(conv, [layer.key_dim, layer.key_dim, layer.value_dim])
        q = q.reshape(-1, layer.head_k_dim).float()
        k = k.reshape(-1, layer.head_k_dim).float()
        if repeat != 1:  # each key head serves consecutive value heads
            q, k = q.repeat_interleave(repeat, dim=0), k.repeat_interleave(repeat, dim=0)
        q, k = _l2norm(q) / (layer.head_k_dim ** 0.5), _l2norm(k)
        v = v.reshape(-1, layer.head_v_dim).float()
        g = decay_rate * F.softplus(a[row].float() + layer.dt_bias)
        beta = b[row].sigmoid().float()
        state = state * g.exp()[:, None, None]
        memory = (state * k.unsqueeze(-1)).sum(dim=-2)
        delta = (v - memory) * beta.unsqueeze(-1)
        state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
        core[row] = (state * q.unsqueeze(-1)).sum(dim=-2)
        if t + 1 in counts:
            taken.append(state)
    return window[segment.length:].clone(), state, taken
