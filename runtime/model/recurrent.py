"""Gated DeltaNet layers (Qwen3.5 dense and MoE) over ponder's recurrent states (storage.recurrent_state).

transformers' linear-attention layer keeps a convolution window and a recurrent matrix per sequence in
its own cache object, which ponder's flattened step (every scheduled sequence's new tokens in one row)
does not pass: without them each step would start from nothing. `RecurrentLayers` replaces each such
layer's forward with `gated_delta_forward`, which runs transformers' arithmetic sequence by sequence
from the state the sequence resumes (`RecurrentStep`), and records the states each sequence ends with
(and at each block boundary it passes) once the step is over.

Every token is computed by the recurrent form, token after token: a state after token t is then one
function of the tokens before it, whatever the steps were cut into, whatever else ran beside it, and
whether the prompt came from the prefix cache, so seeds hold (the chunked form's bits depend on where
a chunk starts). The recurrent update of the rows one position deep is one batched computation whose
arithmetic is per row (elementwise products and a sum over the key dimension), so a row's bits do not
depend on the batch (tested).
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
LAYER_CLASSES = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")
SNAPSHOT_BYTES = 256 << 20  # block-boundary states kept for resuming (prefix cache, forks cut early)


def recurrent_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in LAYER_CLASSES]


def unsupported_recurrent(model: nn.Module) -> str | None:
    """What a model's recurrent layers need that ponder does not run, or None."""
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind.endswith(("GatedDeltaNet", "Mamba", "Mamba2Mixer", "MambaMixer")) and kind not in LAYER_CLASSES:
            return f"{name} is a {kind} layer, whose recurrent state ponder does not hold"
    return None


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

    def __post_init__(self) -> None:
        self.finals = [[] for _ in self.segments]
        self.boundaries = [[] for _ in self.segments]

    def boundary_positions(self, segment: Segment) -> list[int]:
        """Token counts at block boundaries the segment passes (its end included when it is one)."""
        first = -(-(segment.begin + 1) // self.block_size) * self.block_size
        return list(range(first, segment.end + 1, self.block_size))


class RecurrentLayers:
    """The model's Gated DeltaNet layers, run over `states`."""

    def __init__(self, layers: list[nn.Module], states: RecurrentStates) -> None:
        self.layers = layers
        self.states = states
        for index, layer in enumerate(layers):
            layer.forward = partial(gated_delta_forward, layer, index)

    @classmethod
    def build(cls, model: nn.Module, states: RecurrentStates | None) -> "RecurrentLayers | None":
        layers = recurrent_layers(model)
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


def recurrent_states(model: nn.Module, block_size: int) -> RecurrentStates | None:
    """The states a model's recurrent layers need beside its paged KV, or None when it has none."""
    return RecurrentStates(block_size, SNAPSHOT_BYTES) if recurrent_layers(model) else None


def _flat(per_layer: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    return tuple(t for pair in per_layer for t in pair)


def _initial(layer: nn.Module, index: int, resume: Resume, device) -> tuple[torch.Tensor, torch.Tensor]:
    if resume.state is not None:
        return resume.state.tensors[2 * index], resume.state.tensors[2 * index + 1]
    conv = torch.zeros(layer.conv_dim, layer.conv_kernel_size - 1, device=device, dtype=layer.conv1d.weight.dtype)
    recurrent = torch.zeros(layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, device=device, dtype=torch.float32)
    return conv, recurrent


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def gated_delta_forward(layer: nn.Module, index: int, hidden_states: torch.Tensor, cache=None, attention_mask=None,
                        **kwargs) -> torch.Tensor:
    """transformers' Gated DeltaNet forward (its recurrent form) for every segment of the step, each from
    its own state; `hidden_states` is the step's row `[1, T, hidden]` (rows in no segment: padding)."""
    step: RecurrentStep = kwargs["ponder_attention"].recurrent
    x = hidden_states[0]
    num_rows = x.shape[0]
    mixed = layer.in_proj_qkv(x)  # [T, conv_dim]
    z = layer.in_proj_z(x).reshape(num_rows, -1, layer.head_v_dim)
    beta = layer.in_proj_b(x).sigmoid().float()
    g = (-layer.A_log.float().exp() * F.softplus(layer.in_proj_a(x).float() + layer.dt_bias)).float()
    weight = layer.conv1d.weight.squeeze(1)  # [conv_dim, K]
    width = layer.conv_kernel_size
    core = torch.zeros(num_rows, layer.num_v_heads, layer.head_v_dim, dtype=torch.float32, device=x.device)
    starts, lengths, qs, ks, vs, states = [], [], [], [], [], []
    for number, segment in enumerate(step.segments):
        conv_state, recurrent = _initial(layer, index, segment.resume, x.device)
        rows = mixed[segment.row:segment.row + segment.length].transpose(0, 1).to(weight.dtype)  # [C, n]
        window = torch.cat([conv_state, rows], dim=1)  # [C, K-1+n]: the inputs of tokens begin-K+1 .. end-1
        conv = window[:, :segment.length] * weight[:, :1]
        for tap in range(1, width):
            conv = conv + window[:, tap:tap + segment.length] * weight[:, tap:tap + 1]
        if layer.conv1d.bias is not None:
            conv = conv + layer.conv1d.bias[:, None]
        conv = F.silu(conv).to(x.dtype).transpose(0, 1)  # [n, C]
        step.finals[number].append((window[:, segment.length:].clone(), None))
        step.boundaries[number].append({p: (window[:, p - segment.begin:p - segment.begin + width - 1].clone(), None)
                                        for p in step.boundary_positions(segment)})
        q, k, v = torch.split(conv, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
        q = q.reshape(segment.length, -1, layer.head_k_dim)
        k = k.reshape(segment.length, -1, layer.head_k_dim)
        v = v.reshape(segment.length, -1, layer.head_v_dim)
        if layer.num_k_heads != layer.num_v_heads:  # each key head serves consecutive value heads
            q = q.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=1)
            k = k.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=1)
        q, k = _l2norm(q.float()), _l2norm(k.float())
        qs.append(q / (q.shape[-1] ** 0.5))
        ks.append(k)
        vs.append(v.float())
        starts.append(segment.row)
        lengths.append(segment.length)
        states.append(recurrent)
    _recurrent(step, starts, lengths, qs, ks, vs, g, beta, states, core)
    out = layer.norm(core.to(x.dtype).reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(out.reshape(num_rows, -1))[None]


def _recurrent(step: RecurrentStep, starts: list[int], lengths: list[int], qs, ks, vs, g: torch.Tensor,
               beta: torch.Tensor, states: list[torch.Tensor], core: torch.Tensor) -> None:
    """The gated delta rule token after token; the segments' rows at the same depth run as one batch."""
    depth = max(lengths, default=0)
    boundaries = [set(step.boundary_positions(s)) for s in step.segments]
    for t in range(depth):
        active = [i for i, n in enumerate(lengths) if n > t]
        state = torch.stack([states[i] for i in active])  # [A, Hv, dk, dv]
        rows = torch.tensor([starts[i] + t for i in active], device=core.device)
        q = torch.stack([qs[i][t] for i in active])  # [A, Hv, dk]
        k = torch.stack([ks[i][t] for i in active])
        v = torch.stack([vs[i][t] for i in active])  # [A, Hv, dv]
        decay = g.index_select(0, rows).exp()[..., None, None]  # [A, Hv, 1, 1]
        state = state * decay
        memory = (state * k.unsqueeze(-1)).sum(dim=-2)
        delta = (v - memory) * beta.index_select(0, rows).unsqueeze(-1)
        state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
        core.index_copy_(0, rows, (state * q.unsqueeze(-1)).sum(dim=-2))
        for slot, i in enumerate(active):
            states[i] = state[slot]
            position = step.segments[i].begin + t + 1
            if position in boundaries[i]:
                conv, _ = step.boundaries[i][-1][position]
                step.boundaries[i][-1][position] = (conv, state[slot])
    for i, final in enumerate(states):
        conv, _ = step.finals[i][-1]
        step.finals[i][-1] = (conv, final)
