"""The Gated DeltaNet layers' Triton kernel (runtime/kernels/gpu/gated_delta.py, what a CUDA device runs)
in Triton's interpreter, as runtime.model.recurrent calls it: transformers' greedy tokens, the CPU
kernel's seeded tokens, a sequence's bits alone and in a crowd, a prompt resumed from its kept states."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.kernels.gpu.gated_delta import gated_delta_steps
from tests.replicas.hybrid import write_qwen35
from tests.runtime.engine_helpers import request, run
from tests.runtime.model.test_hybrid_recurrent import serves_what_the_cpu_kernel_serves


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    directory = write_qwen35(tmp_path_factory.mktemp("qwen35_triton"))
    return directory, AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def test_the_triton_kernel_serves_what_the_cpu_kernel_serves(dense, monkeypatch):
    from runtime.bootstrap import engine_paths

    def resumed(engine, prompt, greedy):  # the prompt again: it resumes from the states kept at its blocks' ends
        again = run(engine, [request("h", prompt, max_tokens=8)])["h"]
        assert again["finished"].cached_tokens > 0 and again["choices"][0] == greedy

    engine = serves_what_the_cpu_kernel_serves(dense, monkeypatch, gated_delta_steps, resumed)
    assert engine_paths(engine)["recurrent"] == "triton"


def test_states_are_kept_after_the_counts_asked_and_the_carried_inputs_follow_the_tokens():
    """Two sequences (three tokens from a carried window; one token), a state kept after tokens 1 and 3
    of the first: each equals the token loop's (runtime.model.recurrent._in_torch's arithmetic, here
    written out), and the last K-1 inputs are the window's tail."""
    gen = torch.Generator().manual_seed(0)
    hk, hv, dk, dv, taps_n = 1, 2, 8, 4, 3
    channels = 2 * hk * dk + hv * dv
    mixed, taps, bias = (torch.randn(4, channels, generator=gen), torch.randn(taps_n, channels, generator=gen),
                         torch.randn(channels, generator=gen))
    a, b = torch.randn(4, hv, generator=gen), torch.randn(4, hv, generator=gen)
    dt_bias, a_log = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    convs = [torch.randn(taps_n - 1, channels, generator=gen) for _ in range(2)]
    states = [torch.randn(hv, dk, dv, generator=gen) for _ in range(2)]
    core = torch.zeros(4, hv, dv)
    out = gated_delta_steps(mixed, taps, bias, a, b, dt_bias, a_log, convs, states, [0, 3], [3, 1], [1, 3], [2, 0],
                            hk, dk, dv, core)
    assert len(out) == 2 + 2 + 2
    expected_core = torch.zeros(4, hv, dv)
    for s, (row, length) in enumerate([(0, 3), (3, 1)]):
        window = torch.cat([convs[s], mixed[row:row + length]])
        state, kept = states[s].clone(), []
        for t in range(length):
            x = torch.nn.functional.silu((window[t:t + taps_n] * taps).sum(0) + bias)
            q, k, v = x[:dk], x[dk:2 * dk], x[2 * dk:].reshape(hv, dv)
            q = q * torch.rsqrt((q * q).sum() + 1e-6) / dk ** 0.5
            k = k * torch.rsqrt((k * k).sum() + 1e-6)
            g = -a_log.exp() * torch.nn.functional.softplus(a[row + t] + dt_bias)
            state = state * g.exp()[:, None, None]
            delta = (v - (state * k[None, :, None]).sum(1)) * b[row + t].sigmoid()[:, None]
            state = state + k[None, :, None] * delta[:, None, :]
            expected_core[row + t] = (state * q[None, :, None]).sum(1)
            kept.append(state)
        first = 0 if s == 0 else 4
        torch.testing.assert_close(out[first], window[length:], atol=0, rtol=0)
        torch.testing.assert_close(out[first + 1], state, atol=1e-5, rtol=1e-5)
        if s == 0:
            torch.testing.assert_close(out[2], kept[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out[3], kept[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(core, expected_core, atol=1e-5, rtol=1e-5)
