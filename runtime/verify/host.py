"""What the verifiers ask of the engine they score for (their ports); the engine satisfies them.

A reward model's store prefills in its own pool, so it needs the engine only to fail a request it
cannot hold and to report how long a verification took. The judge asks the generator itself, so
its questions are sequences in the engine's own pool: forked, parked and released there.
"""

from __future__ import annotations

from typing import Protocol

from scheduler.sequence import Sequence


class VerifierHost(Protocol):
    def fail_request(self, request_id: str, message: str, status: int = 503,
                     code: str = "kv_cache_exhausted") -> None: ...

    def observe_verifier(self, seconds: float) -> None: ...


class JudgeHost(Protocol):
    def fork_prompt(self, parent: Sequence, token_ids: list[int], num_shared: int) -> Sequence: ...

    def add_scoring_fork(self, seq: Sequence, controller) -> None: ...

    def add_scoring_sequence(self, seq: Sequence, controller) -> None: ...

    def park_sequence(self, seq: Sequence) -> None: ...

    def release_sequence(self, seq: Sequence) -> None: ...

    def observe_verifier(self, seconds: float) -> None: ...
