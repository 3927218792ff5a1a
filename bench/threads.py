"""Run a benchmark under a given torch thread count, restoring the caller's afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
