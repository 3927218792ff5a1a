"""The GPU path's Triton kernels run on a CPU in Triton's interpreter. `TRITON_INTERPRET` is read when a
kernel is decorated and again while it runs, so it is set here, before the kernel modules are first
imported, and stays set for the session. Only Triton reads it, and on a machine without CUDA nothing
else in the suite imports Triton (torch imports it only for `torch.compile`'s GPU backend).

Where CUDA is available these tests are left out: the interpreter would then also run the kernels of
every `cuda` test in the session, which must compile them for the GPU."""

from __future__ import annotations

import os

import torch

if torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ["TRITON_INTERPRET"] = "1"
