"""ponder's Triton kernels for the decode step on a GPU (runtime.model.gpu_layers runs them).

Each kernel computes one row (a token, or a token's head) from that row's inputs only, in an order
fixed by the row's own shape, so a row's bits never depend on what else is in the step. On a CPU they
run in Triton's interpreter (`TRITON_INTERPRET=1` before the first import), which the tests use.
"""

from __future__ import annotations

import torch


def runs_on(device: torch.device) -> bool:
    """Whether ponder runs its Triton kernels for a step on `device`: a CUDA device, with Triton importable
    (a CPU runs them only when a test asks, in Triton's interpreter)."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def attends(device: torch.device, block_size: int) -> bool:
    """Whether the Triton decode kernel attends a step's generated tokens on `device` (each query alone, so
    there is no batched matmul for the start-up probe to check): `runs_on(device)` and a block size that
    is a power of two (the kernel reads a block as one tile)."""
    return runs_on(device) and block_size > 0 and block_size & (block_size - 1) == 0
