"""What a search asks of the engine it runs on (its port); the engine satisfies it.

A search holds only sequences and paths: it forks, parks, resumes and releases its paths'
sequences, asks for a step's groups and prepares the next one, and hands back messages and the
work to do once a step's tokens are all handed out. Tokenizer facts and the limits it decodes
within are read here too; blocks are only counted, never touched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from runtime.wire.protocol import FromRuntime
from scheduler.kv_manager import KVManager
from scheduler.sequence import Sequence

if TYPE_CHECKING:
    import torch


class SearchLimits(Protocol):
    @property
    def max_model_len(self) -> int: ...

    @property
    def speculative_extension(self) -> bool: ...


class SearchHost(Protocol):
    @property
    def config(self) -> SearchLimits: ...

    @property
    def tokenizer(self): ...

    @property
    def eos_ids(self) -> frozenset[int]: ...

    @property
    def device(self) -> "torch.device": ...

    @property
    def kv(self) -> KVManager: ...  # for block counts: what a step's tokens will take

    def fork_sequence(self, parent: Sequence, num_tokens: int | None = None) -> Sequence: ...

    def release_sequence(self, seq: Sequence) -> None: ...

    def park_sequence(self, seq: Sequence) -> None: ...

    def resume_sequence(self, seq: Sequence) -> None: ...

    def has_idle_slot(self) -> bool: ...

    def plan_step(self, seqs: list[Sequence], step_tokens: list[int]) -> list[list[int]]: ...

    def prepare_group(self, seqs: list[Sequence], reserve: int) -> None: ...

    def defer(self, callback: Callable[[], None]) -> None: ...

    def emit(self, message: FromRuntime) -> None: ...

    def abandon_scoring(self, controller) -> None: ...

    def search_finished(self, controller) -> None: ...
