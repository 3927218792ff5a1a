"""The GPU path's Triton kernels run on a CPU in Triton's interpreter. `TRITON_INTERPRET` is read when a
kernel is decorated and again while it runs, so it is set here, before the kernel modules are first
imported, and stays set. Only Triton reads it, and nothing else in the suite imports Triton (torch
imports it only for `torch.compile`'s GPU backend, which no test uses)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
