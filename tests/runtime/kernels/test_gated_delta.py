"""ponder's Gated DeltaNet kernel over a whole step (`gated_delta_steps`, runtime/kernels/csrc/gated_delta.cpp):
sequences of different lengths, continuing different states, in one call, each with the bits it has
alone in one call of the one-sequence op, whatever rows it lies at, whatever else the step holds and
whether its inputs are column slices of a wider projection's output."""

from __future__ import annotations

import pytest
import torch

HK, HV, DK, DV, WIDTH = 2, 4, 64, 32, 4
CHANNELS = 2 * HK * DK + HV * DV


@pytest.fixture(scope="module")
def kernels():
    from runtime.kernels.cpu_kernels import KernelUnavailable, gated_delta_kernel, gated_delta_steps_kernel

    try:
        return gated_delta_kernel(), gated_delta_steps_kernel()
    except KernelUnavailable as exc:
        pytest.skip(str(exc))


def layer(g: torch.Generator) -> tuple:
    taps, bias = torch.randn(WIDTH, CHANNELS, generator=g), torch.randn(CHANNELS, generator=g)
    return taps, bias, torch.randn(HV, generator=g), torch.rand(HV, generator=g)


def test_a_step_s_sequences_in_one_call_have_their_bits_alone(kernels):
    one, steps = kernels
    g = torch.Generator().manual_seed(1)
    taps, bias, dt_bias, a_log = layer(g)
    lengths, rows, counts = [5, 1, 0, 9, 2], [1, 6, 7, 7, 16], [[2, 5], [], [], [4], [1]]
    num_rows = 19  # (rows 0, 18: padding)
    # mixed, a and b as column slices of one projection's output, as the lean decoder hands them
    projected = torch.randn(num_rows, CHANNELS + 2 * HV + 3, generator=g)
    mixed, a, b = projected[:, :CHANNELS], projected[:, CHANNELS:CHANNELS + HV], projected[:, CHANNELS + HV:-3]
    convs = [torch.randn(WIDTH - 1, CHANNELS, generator=g) for _ in lengths]
    states = [torch.randn(HV, DK, DV, generator=g) for _ in lengths]
    originals = [s.clone() for s in states]
    core = torch.full((num_rows, HV, DV), 7.0)
    out = steps(mixed, taps, bias, a, b, dt_bias, a_log, convs, states, rows, lengths, [c for cs in counts for c in cs],
                [len(cs) for cs in counts], HK, DK, DV, core)
    assert len(out) == 2 * len(lengths) + sum(map(len, counts))
    assert all(torch.equal(s, o) for s, o in zip(states, originals))  # (read, never written)
    assert torch.equal(core[0], torch.full((HV, DV), 7.0)) and torch.equal(core[18], core[0])  # rows in no sequence
    at = 0
    for s, (row, length) in enumerate(zip(rows, lengths)):
        window = torch.cat([convs[s], mixed[row:row + length]])
        alone = torch.zeros(length, HV, DV)
        final, *taken = one(window, taps, bias, a[row:row + length].contiguous(), b[row:row + length].contiguous(),
                            dt_bias, a_log, states[s], HK, DK, DV, counts[s], alone)
        assert torch.equal(out[at], window[length:])  # the last K-1 convolution inputs
        assert torch.equal(out[at + 1], final) and len(taken) == len(counts[s])
        assert all(torch.equal(x, y) for x, y in zip(out[at + 2:at + 2 + len(taken)], taken))
        assert torch.equal(core[row:row + length], alone)
        at += 2 + len(counts[s])
    assert torch.equal(out[6], convs[2]) and torch.equal(out[7], states[2])  # an empty one keeps its states
    # the same sequence alone in a step of its own, at row 0: the same bits
    alone = torch.zeros(9, HV, DV)
    solo = steps(mixed[7:16].contiguous(), taps, bias, a[7:16].contiguous(), b[7:16].contiguous(), dt_bias, a_log,
                 [convs[3]], [states[3]], [0], [9], [4], [1], HK, DK, DV, alone)
    assert torch.equal(alone, core[7:16]) and all(torch.equal(x, y) for x, y in zip(solo, out[8:11]))


def test_a_step_s_shapes_are_checked(kernels):
    _, steps = kernels
    g = torch.Generator().manual_seed(2)
    taps, bias, dt_bias, a_log = layer(g)
    mixed, a, b = torch.randn(3, CHANNELS), torch.randn(3, HV), torch.randn(3, HV)
    conv, state = torch.zeros(WIDTH - 1, CHANNELS), torch.zeros(HV, DK, DV)
    with pytest.raises(RuntimeError, match="outside the step"):
        steps(mixed, taps, bias, a, b, dt_bias, a_log, [conv], [state], [1], [3], [], [0], HK, DK, DV,
              torch.zeros(3, HV, DV))
    with pytest.raises(RuntimeError, match="counts must sum"):
        steps(mixed, taps, bias, a, b, dt_bias, a_log, [conv], [state], [0], [3], [1], [0], HK, DK, DV,
              torch.zeros(3, HV, DV))
