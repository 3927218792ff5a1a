"""Measured peaks: positive, finite, in the range of real hardware."""

import math

import pytest
import torch

from runtime.kv.device_profile import measure_bandwidth, measure_flops, measure_peaks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_peaks_are_plausible(dtype):
    peaks = measure_peaks("cpu", dtype)
    # From a busy laptop core (~1 GFLOP/s, ~1 GB/s) to the largest accelerators (~1e16, ~1e13).
    assert math.isfinite(peaks.flops) and 1e8 < peaks.flops < 1e16
    assert math.isfinite(peaks.bandwidth) and 1e8 < peaks.bandwidth < 1e13


def test_explicit_sizes_and_a_dtype_without_float_matmuls():
    assert 1e6 < measure_flops("cpu", torch.float32, size=64) < 1e16
    assert 1e6 < measure_flops("cpu", torch.int8, size=64) < 1e16  # timed in float32 instead
    assert 1e6 < measure_bandwidth("cpu", num_bytes=1 << 20) < 1e13


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_peaks_are_plausible():
    peaks = measure_peaks("cuda", torch.bfloat16)
    assert 1e12 < peaks.flops < 1e16 and 1e10 < peaks.bandwidth < 1e13
