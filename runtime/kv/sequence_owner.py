"""Whom a sequence's logits go to: the one protocol every `Sequence.owner` meets.

Owners are a plain request's choices, a search's paths, look-aheads and prompt, and the judge's
questions; the engine's step hands them their logits and sampled tokens. It lives in the KV room,
below every room whose parts are owners, so each may name it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.model.sampler import SampleOutput
from scheduler.sequence import Sequence


class SequenceOwner(Protocol):
    """`on_logits` gets the row of a sequence whose prompt is computed or whose token is due, and
    returns the sequences that sample from it (each with its own owner's `sampling`); each then
    hears its token through `on_sampled`. An owner of a prompt that is only prefilled (a search's
    root, a judge's question) returns none, so its own `on_sampled` is never reached."""

    @property
    def request_id(self) -> str: ...

    def on_logits(self, seq: Sequence, row: torch.Tensor) -> list[Sequence]: ...

    def on_sampled(self, seq: Sequence, out: SampleOutput) -> None: ...
