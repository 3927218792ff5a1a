"""The GPU path's Triton kernels run on a CPU in Triton's interpreter (`TRITON_INTERPRET`, set for
the session in tests/conftest.py before anything imports a kernel).

Where CUDA is available these tests are left out: the interpreter would then also run the kernels of
every `cuda` test in the session, which must compile them for the GPU."""

from __future__ import annotations

import torch

if torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]
