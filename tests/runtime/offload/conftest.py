"""The tiny llama of tests/conftest.py, loaded the way ponder loads models."""

from __future__ import annotations

import pytest
import torch

from runtime import attention
from runtime.loader import ModelSource, load_causal_lm


@pytest.fixture(scope="session")
def model(tiny_llama):
    return load_causal_lm(ModelSource("tiny", str(tiny_llama)), torch.device("cpu"), torch.float32,
                          attention.register())


@pytest.fixture(autouse=True)
def one_compute_thread():
    """Tiny matmuls gain nothing from a second thread, and on a busy two-core machine its spinning
    costs seconds; the thread count is put back after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
