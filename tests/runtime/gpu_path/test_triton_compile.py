"""ponder's Triton kernels compiled for a Hopper GPU (sm_90) on a machine without one, by Triton's own
compiler and ptxas (tests/runtime/gpu_path/compile_kernels.py, in a process of its own: this session's
kernels are interpreted): the interpreter the other tests use forgives what a GPU would refuse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_every_kernel_compiles_for_a_hopper_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.runtime.gpu_path.compile_kernels"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 28
    assert {name: error for name, error in results.items() if error} == {}
