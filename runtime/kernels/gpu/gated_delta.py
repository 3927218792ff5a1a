"""A step's sequences through a Gated DeltaNet layer past its projections, as Triton kernels: the GPU's
twin of ponder's CPU kernel (runtime/kernels/csrc/gated_delta.cpp, `torch.ops.ponder.gated_delta_steps`),
with its arguments and its outputs, so runtime.model.recurrent.DeltaRule calls either the same way.

One program per (sequence, value head, block of value dimensions) holds that block of the head's
recurrent state in registers and runs the sequence's tokens one after the other: the causal
convolution (its taps summed in order, then the bias), silu, the l2 norms of the key head's query and
key, the decay and beta from `a` and `b`, the state's decay, the delta rule's update and the output.
Every sum runs in an order fixed by the shapes alone, and nothing crosses programs, so a sequence's
bits do not depend on the other sequences of the step (batch invariance by construction), and a state
after token t is one function of the tokens before it however the steps were cut. A second kernel
writes each sequence's last K-1 convolution inputs (what its next step resumes from). The arithmetic
is float32 throughout (the inputs are given in float32, as to the CPU kernel).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence as Seq

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_delta(mixed_ptr, taps_ptr, bias_ptr, a_ptr, b_ptr, dt_ptr, alog_ptr, conv_ptr, state_ptr, rows_ptr,
                 lengths_ptr, slots_ptr, core_ptr, final_ptr, snap_ptr, channels, root, HV: tl.constexpr,
                 REPEAT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KEY_DIM: tl.constexpr,
                 TAPS: tl.constexpr, BV: tl.constexpr, HAS_BIAS: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    dk = tl.arange(0, DK)
    v_ok = dv < DV
    row0 = tl.load(rows_ptr + s)
    n = tl.load(lengths_ptr + s)
    kh = h // REPEAT
    channel_q = kh * DK + dk
    channel_k = KEY_DIM + kh * DK + dk
    channel_v = 2 * KEY_DIM + h * DV + dv
    tile = (s * HV + h) * DK * DV + dk[:, None] * DV + dv[None, :]
    tile_ok = v_ok[None, :] & (dk[:, None] < DK)
    state = tl.load(state_ptr + tile, mask=tile_ok, other=0.0)
    decay = -tl.exp(tl.load(alog_ptr + h))
    dt = tl.load(dt_ptr + h)
    conv_base = conv_ptr + s * (TAPS - 1) * channels
    t = tl.zeros((), dtype=tl.int32)  # (a tensor: the loop carries it)
    while t < n:  # (a while loop: Triton's interpreter cannot range over a loaded value)
        q = tl.zeros((DK,), tl.float32)
        k = tl.zeros((DK,), tl.float32)
        v = tl.zeros((BV,), tl.float32)
        for j in tl.static_range(TAPS):  # window[t + j]: the carried inputs first, then the step's rows
            w = t + j
            carried = w < TAPS - 1
            old = conv_base + w * channels
            new = mixed_ptr + (row0 + w - (TAPS - 1)) * channels
            q += _window(old, new, carried, channel_q, dk < DK) * tl.load(taps_ptr + j * channels + channel_q)
            k += _window(old, new, carried, channel_k, dk < DK) * tl.load(taps_ptr + j * channels + channel_k)
            v += _window(old, new, carried, channel_v, v_ok) * tl.load(taps_ptr + j * channels + channel_v,
                                                                         mask=v_ok, other=0.0)
        if HAS_BIAS:
            q += tl.load(bias_ptr + channel_q)
            k += tl.load(bias_ptr + channel_k)
            v += tl.load(bias_ptr + channel_v, mask=v_ok, other=0.0)
        q = q / (1.0 + tl.exp(-q))
        k = k / (1.0 + tl.exp(-k))
        v = v / (1.0 + tl.exp(-v))
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) / root
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        row = row0 + t
        x = tl.load(a_ptr + row * HV + h) + dt
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + row * HV + h)))
        state = state * tl.exp(decay * softplus)
        memory = tl.sum(state * k[:, None], axis=0)
        state = state + k[:, None] * ((v - memory) * beta)[None, :]
        tl.store(core_ptr + (row * HV + h) * DV + dv, tl.sum(state * q[:, None], axis=0), mask=v_ok)
        slot = tl.load(slots_ptr + row)  # (this token ends a block whose state is kept: its place, else -1)
        if slot >= 0:
            tl.store(snap_ptr + slot * HV * DK * DV + (h * DK * DV + dk[:, None] * DV + dv[None, :]), state,
                     mask=tile_ok)
        t += 1
    tl.store(final_ptr + tile, state, mask=tile_ok)


@triton.jit
def _window(old, new, carried, channel, ok):
    """A convolution input: from the carried inputs (`old`) or the step's row (`new`), read where it is."""
    return tl.where(carried, tl.load(old + channel, mask=ok & carried, other=0.0),
                    tl.load(new + channel, mask=ok & (carried == 0), other=0.0))


@triton.jit
def _conv_tails(mixed_ptr, conv_ptr, rows_ptr, lengths_ptr, out_ptr, channels, TAPS: tl.constexpr,
                BLOCK: tl.constexpr):
    s = tl.program_id(0)
    j = tl.program_id(1)  # tail row j: window[n + j]
    c = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    ok = c < channels
    n = tl.load(lengths_ptr + s)
    w = n + j
    carried = w < TAPS - 1
    value = _window(conv_ptr + (s * (TAPS - 1) + w) * channels,
                    mixed_ptr + (tl.load(rows_ptr + s) + w - (TAPS - 1)) * channels, carried, c, ok)
    tl.store(out_ptr + (s * (TAPS - 1) + j) * channels + c, value, mask=ok)


def gated_delta_steps(mixed: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      dt_bias: torch.Tensor, a_log: torch.Tensor, conv_states: Seq[torch.Tensor],
                      states: Seq[torch.Tensor], rows: Seq[int], lengths: Seq[int], counts: Seq[int],
                      count_lengths: Seq[int], num_k_heads: int, head_k_dim: int, head_v_dim: int,
                      core: torch.Tensor) -> list[torch.Tensor]:
    """`torch.ops.ponder.gated_delta_steps`' arguments and outputs: the step's float32 convolution inputs
    `mixed` `[T, C]`, `taps` `[K, C]`, `bias` `[C]` (or empty), `a`, `b` `[T, Hv]`, `dt_bias`, `A_log`
    `[Hv]`; per sequence its carried K-1 convolution inputs, its state `[Hv, dk, dv]`, its first row and
    token count; the token counts after which its state is kept (`counts`, `count_lengths` of them a
    sequence). Writes the outputs `core` `[T, Hv, dv]`; returns per sequence its last K-1 convolution
    inputs, its final state, then its states at its counts."""
    sequences, width, channels = len(rows), taps.shape[0], taps.shape[1]
    hv = a.shape[1]
    device = mixed.device
    assert all(t.dtype == torch.float32 for t in (mixed, taps, a, b, dt_bias, a_log, core))
    assert head_k_dim & (head_k_dim - 1) == 0, "the kernel holds a key head as one tile: a power-of-two head_k_dim"
    key_dim = num_k_heads * head_k_dim
    assert channels == 2 * key_dim + hv * head_v_dim and hv % num_k_heads == 0
    taken = sum(count_lengths)
    carried = torch.stack(list(conv_states)) if sequences else mixed.new_empty((0, width - 1, channels))
    initial = torch.stack(list(states)) if sequences else mixed.new_empty((0, hv, head_k_dim, head_v_dim))
    rows_t, lengths_t, slots_t = _step_rows(tuple(rows), tuple(lengths), tuple(counts), tuple(count_lengths),
                                            mixed.shape[0], device)
    finals = torch.empty_like(initial)
    snapshots = mixed.new_empty((taken, hv, head_k_dim, head_v_dim))
    tails = mixed.new_empty((sequences, width - 1, channels))
    if sequences:
        block_v = min(64, triton.next_power_of_2(head_v_dim))
        _gated_delta[(sequences, hv, triton.cdiv(head_v_dim, block_v))](
            mixed.contiguous(), taps.contiguous(), bias if bias.numel() else taps, a.contiguous(), b.contiguous(),
            dt_bias.contiguous(), a_log.contiguous(), carried.contiguous(), initial.contiguous(), rows_t, lengths_t,
            slots_t, core, finals, snapshots, channels, float(head_k_dim) ** 0.5, HV=hv, REPEAT=hv // num_k_heads, DK=head_k_dim,
            DV=head_v_dim, KEY_DIM=key_dim, TAPS=width, BV=block_v, HAS_BIAS=bias.numel() > 0)
        if width > 1:
            block = min(1024, triton.next_power_of_2(channels))
            _conv_tails[(sequences, width - 1, triton.cdiv(channels, block))](
                mixed.contiguous(), carried.contiguous(), rows_t, lengths_t, tails, channels, TAPS=width, BLOCK=block)
    out, at = [], 0
    for s, kept in enumerate(_split(counts, count_lengths)):
        out += [tails[s], finals[s], *snapshots[at:at + len(kept)]]
        at += len(kept)
    return out


@functools.lru_cache(maxsize=1)
def _step_rows(rows: tuple, lengths: tuple, counts: tuple, count_lengths: tuple, num_rows: int, device) -> tuple:
    """(each sequence's first row, its token count, each row's place among the kept states or -1) as int32
    on `device`, one copy; the step's every recurrent layer asks the same, so it is made once a step."""
    slots = [-1] * num_rows
    at = 0
    for row, length, kept in zip(rows, lengths, _split(counts, count_lengths)):
        assert all(0 < c <= length for c in kept)
        for c in kept:
            slots[row + c - 1] = at
            at += 1
    joined = torch.tensor([*rows, *lengths, *slots], dtype=torch.int32).to(device)
    n = len(rows)
    return joined[:n], joined[n:2 * n], joined[2 * n:]


def _split(counts: Seq[int], lengths: Seq[int]) -> list[list[int]]:
    out, at = [], 0
    for n in lengths:
        out.append(list(counts[at:at + n]))
        at += n
    return out
