"""How any room changes the compute pool's sequences: the one typed port every asker uses.

The engine owns the scheduler's queues and the KV manager and satisfies this port; no other room
reaches them. Plain requests call it as their tokens come (runtime.requests.host adds what only they
ask); the judge calls it through the step's work, which keeps each request's questions
(runtime.verify.host); a search asks in its plan (runtime.search.plan), and the step's work carries
each action out with the call of this port it names (runtime.steps.host). A sequence the pool cannot
hold is a result, never an exception: the scheduler's plan names it (`blocked`), and head-wise
planning answers `NoFit` (runtime.kv.head_pieces). It lives in the KV room, below every room that
asks, so each may name it.
"""

from __future__ import annotations

from typing import Protocol

from scheduler.sequence import Sequence


class SequenceHost(Protocol):
    def add_sequence(self, seq: Sequence) -> None: ...  # queued: admitted once its blocks fit

    def fork_sequence(self, parent: Sequence, child: Sequence, num_tokens: int | None) -> None:
        """`child` (made by the asker) shares the blocks of `parent`'s first `num_tokens` tokens (all
        when None); parked until resumed."""

    def fork_prompt(self, parent: Sequence, child: Sequence, num_shared: int) -> None:
        """`child`, a new prompt (made by the asker) whose first `num_shared` tokens are `parent`'s,
        shares their blocks and counts them as cached; parked until resumed."""

    def resume_sequence(self, seq: Sequence) -> None: ...  # runs again from the next step

    def park_sequence(self, seq: Sequence) -> None: ...  # stops running and keeps its blocks

    def release_sequence(self, seq: Sequence) -> None: ...  # finished: its blocks go back (none if already)
