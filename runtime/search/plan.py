"""What a search wants the engine to do, as data: its plan.

A search never changes the engine's state. Whatever reaches it (a step's logits or tokens, a score,
the deadline check, the end of a step) adds what it wants done to its plan: forks, releases, parks,
resumes, a step's grouping, the next group's prefetch, a verification, its messages. Right after
each such call the step's work (`runtime.steps.work`) takes the plan and carries it out in order
through the engine, so every action lands where the search asked for it, before anything else
touches the pool.

Two answers come back: a `GroupStep` is answered with the groups the engine planned
(`SearchController.start_groups`), and `advance` asks the engine to call `advance()` once the step's
tokens have all been handed out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.wire.protocol import FromRuntime
from scheduler.sequence import Sequence


@dataclass(frozen=True, eq=False)
class Fork:
    """`child` (made by the search) shares the blocks of `parent`'s first `num_tokens` tokens (all
    when None) and stays parked until resumed."""

    parent: Sequence
    child: Sequence
    num_tokens: int | None


@dataclass(frozen=True, eq=False)
class Release:
    seq: Sequence  # finished: its blocks go back (nothing when it was already released)


@dataclass(frozen=True, eq=False)
class Park:
    seq: Sequence  # stops running and keeps its blocks


@dataclass(frozen=True, eq=False)
class Resume:
    seq: Sequence  # runs again from the next step


@dataclass(frozen=True, eq=False)
class GroupStep:
    """A step's paths to run in groups that fit the pool now: the engine plans them and hands the
    groups, as indices into `seqs`, to the search's `start_groups`."""

    seqs: list[Sequence]
    step_tokens: list[int]  # the most tokens each may decode in the step


@dataclass(frozen=True, eq=False)
class Prefetch:
    """The group after the running one: keep its blocks, and bring up those in a lower tier, with
    `reserve` blocks left for the running group to grow into."""

    seqs: list[Sequence]
    reserve: int


@dataclass(frozen=True, eq=False)
class Verify:
    """Hand `paths` to the search's verifier, a model: its scores come back in later steps."""

    paths: list


@dataclass(frozen=True, eq=False)
class Emit:
    message: FromRuntime


@dataclass(frozen=True, eq=False)
class AbandonScoring:
    """Drop the verification under way: queued reward-model jobs, the judge's questions."""


@dataclass(frozen=True, eq=False)
class Answered:
    """The search has sent its answer: the engine forgets it."""


Action = Fork | Release | Park | Resume | GroupStep | Prefetch | Verify | Emit | AbandonScoring | Answered


@dataclass(eq=False)
class SearchPlan:
    actions: list[Action] = field(default_factory=list)
    advance: bool = False  # the running group is done: advance() once the step's tokens are handed out

    def take(self) -> "SearchPlan":
        """What was asked since the last take, handed over; this plan starts empty again (the search's
        parts keep asking through it)."""
        taken = SearchPlan(self.actions, self.advance)
        self.actions, self.advance = [], False
        return taken

    def fork(self, parent: Sequence, num_tokens: int | None = None) -> Sequence:
        """A child of `parent`'s first `num_tokens` tokens (all by default), parked until resumed."""
        child = Sequence(parent.token_ids[:num_tokens], parent.num_prompt_tokens)
        self.actions.append(Fork(parent, child, num_tokens))
        return child

    def release(self, seq: Sequence) -> None:
        self.actions.append(Release(seq))

    def park(self, seq: Sequence) -> None:
        self.actions.append(Park(seq))

    def resume(self, seq: Sequence) -> None:
        self.actions.append(Resume(seq))

    def group_step(self, seqs: list[Sequence], step_tokens: list[int]) -> None:
        self.actions.append(GroupStep(seqs, step_tokens))

    def prefetch(self, seqs: list[Sequence], reserve: int) -> None:
        self.actions.append(Prefetch(seqs, reserve))

    def verify(self, paths: list) -> None:
        self.actions.append(Verify(paths))

    def emit(self, message: FromRuntime) -> None:
        self.actions.append(Emit(message))

    def abandon_scoring(self) -> None:
        self.actions.append(AbandonScoring())

    def answered(self) -> None:
        self.actions.append(Answered())
