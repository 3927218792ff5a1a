"""What the step's work asks of the engine (its port); the engine satisfies it.

The engine owns the compute pool, its queues and the outbox; the work changes none of them itself.
Every change a search (or the judge it asked) wants reaches the engine through these calls, made
from one place: `StepWork` carrying out a plan (`runtime.search.plan`), action by action, in order,
each sequence's change through the port every room uses (runtime.kv.sequence_host).
"""

from __future__ import annotations

from typing import Protocol

from runtime.kv.sequence_host import SequenceHost
from runtime.search.host import SearchHost
from runtime.wire.protocol import FromRuntime
from scheduler.sequence import Sequence


class StepsHost(SearchHost, SequenceHost, Protocol):
    def has_waiting(self) -> bool: ...  # whether other work waits for slots (speculation gives its back)

    def plan_step(self, seqs: list[Sequence], step_tokens: list[int]) -> list[list[int]]: ...  # groups that fit

    def prefetch(self, seqs: list[Sequence], reserve: int) -> None: ...

    def emit(self, message: FromRuntime) -> None: ...

    def search_finished(self, controller) -> None: ...  # it answered: the engine counts it, the work forgets it

    def fail_request(self, request_id: str, message: str, status: int = 503,
                     code: str = "kv_cache_exhausted") -> None: ...
