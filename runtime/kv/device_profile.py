"""Measured device peaks for the roofline KV split, when the settings leave them unset.

Peak FLOP/s: a square matmul in the model's dtype; peak bandwidth: a copy of a large tensor (each
byte read once and written once). Each is the best of a few timed runs after a warm-up, so a
scheduler hiccup lowers no figure. Sizes are chosen per device so the whole profile takes well under
a second: matmuls up to 1024 wide on a CPU and 8192 on a GPU, a 64 MiB copy on a CPU and up to 1 GiB
on a GPU.
These are achieved, not data-sheet, peaks: what the model's own kernels can reach on this machine.
"""

from __future__ import annotations

import time

import torch

from scheduler.roofline import DevicePeaks

_NUM_RUNS = 3
_GROW_BELOW_SECONDS = 0.02


def measure_peaks(device: torch.device | str, dtype: torch.dtype) -> DevicePeaks:
    device = torch.device(device)
    return DevicePeaks(flops=measure_flops(device, dtype), bandwidth=measure_bandwidth(device))


def measure_flops(device: torch.device | str, dtype: torch.dtype, size: int | None = None) -> float:
    """FLOP/s of square matmuls in `dtype` (2 size^3 FLOPs each). Without `size`, the size doubles
    from 256 while one matmul takes under 20 ms, up to the device's cap: a slow dtype (fp16 on some
    CPUs runs at ~2 GFLOP/s) stops early, and a busy CPU whose threads stall a scheduler tick (~16
    ms) a matmul still reaches a size where the stall is not most of the time."""
    device = torch.device(device)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        dtype = torch.float32  # quantized or integer weights run their matmuls in a float dtype
    if size is None:
        cap = 8192 if device.type == "cuda" else 1024
        size = 256
        while size < cap and _best_time(device, *_matmul(device, dtype, size), num_runs=1) < _GROW_BELOW_SECONDS:
            size *= 2
    seconds = _best_time(device, *_matmul(device, dtype, size))
    return 2 * size**3 / seconds


def _matmul(device: torch.device, dtype: torch.dtype, size: int):
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    return (lambda: torch.matmul(a, b, out=out)),


def measure_bandwidth(device: torch.device | str, num_bytes: int | None = None) -> float:
    """Bytes/s of a device-to-device copy of `num_bytes` (counted twice: read and written)."""
    device = torch.device(device)
    if num_bytes is None:
        num_bytes = 64 << 20
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            num_bytes = max(num_bytes, min(1 << 30, free // 8))
    src = torch.empty(num_bytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = _best_time(device, lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / seconds


def _best_time(device: torch.device, run, num_runs: int = _NUM_RUNS) -> float:
    with torch.inference_mode():
        run()  # warm-up: kernel selection, page faults, lazy init
        _synchronize(device)
        best = float("inf")
        for _ in range(num_runs):
            start = time.perf_counter()
            run()
            _synchronize(device)
            best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
