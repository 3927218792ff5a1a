"""The owners of a search's sequences (`runtime.kv.sequence_owner`): its paths, their look-ahead
forks, their speculative branches and the prompt's root."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from runtime.model.detokenizer import StepText
from runtime.model.sampler import SampleOutput, SamplingState
from runtime.search.aggregate import aggregate
from scheduler.sequence import Sequence


class PathEvents(Protocol):
    """What the owners here tell their search (`runtime.search.controller.SearchController`)."""

    @property
    def request_id(self) -> str: ...

    def spawn(self, root: Sequence) -> list[Sequence]: ...

    def on_token(self, path: "SearchPath", out: SampleOutput) -> None: ...

    def on_lookahead_token(self, run: "Lookahead", out: SampleOutput) -> None: ...


@dataclass(eq=False)
class StepAhead:
    """A step decoded speculatively (runtime.search.speculation): from `start`, the search's step
    `step`; once its tokens complete it, its `end` and the path's finish reason there."""

    start: int
    step: int
    logprobs: list[float] = field(default_factory=list)
    end: int | None = None
    finish: str | None = None
    adopted: bool = False  # decoded by a branch that a child adopted (not by the path itself)
    score: float | None = None  # the verifier's score of it, where that is free to read ahead (complete)


@dataclass(eq=False)
class SearchPath:
    controller: PathEvents
    uid: int
    subtree: int
    seq: Sequence
    sampling: SamplingState
    aggregation: str
    step_start: int = 0  # token index where the current step began
    step_end: int = 0  # token index where the last step ended; tokens after it are speculative
    chunk_start: int = 0  # token index where the current (not yet verified) unit began
    chunks: list[str] = field(default_factory=list)  # verified units of text
    step_scores: list[float] = field(default_factory=list)
    chunk_logprobs: list[float] = field(default_factory=list)
    is_done: bool = False
    finish_reason: str | None = None
    text: str = ""
    # A greedy look-ahead past the step, scored with it and then thrown away.
    lookahead_units: list[str] = field(default_factory=list)
    lookahead_logprobs: list[float] = field(default_factory=list)
    next_score: tuple[str, float] | None = None  # (next unit, its score) from a look-ahead verification
    step_text: StepText | None = None  # the text of the step being decoded (or speculated), incrementally
    node: int = 0  # its node in the search tree: the step being decoded, or the prompt before the first
    seed_key: tuple[int, ...] = ()  # what its sampler's seed derives from (`SearchController.child_sampling`)

    def child_seed_key(self, ordinal: int, at: int | None = None) -> tuple[int, ...]:
        """What its `ordinal`-th new child at token index `at` (its step's end) draws its seed from: its
        own key, the fork point and the ordinal, never the order of expansion, so a speculative branch
        decoding that child before the step settles (runtime.search.speculation) draws exactly the
        child's tokens."""
        return self.seed_key + (self.step_end if at is None else at, ordinal)

    @property
    def num_speculative(self) -> int:
        return len(self.seq.token_ids) - self.step_end

    def scoring_units(self) -> list[str]:
        return self.chunks + self.lookahead_units

    @property
    def score(self) -> float:
        return aggregate(self.step_scores, self.aggregation) if self.step_scores else float("-inf")

    @property
    def request_id(self) -> str:
        return self.controller.request_id

    def on_logits(self, seq, row):
        return [seq]

    def on_sampled(self, seq, out) -> None:
        self.controller.on_token(self, out)


@dataclass(eq=False)
class Lookahead:
    """A throwaway fork of a path that decodes `lookahead` more steps greedily before scoring."""

    path: SearchPath
    seq: Sequence
    sampling: SamplingState
    start: int  # token index where the look-ahead began
    steps_left: int
    step_start: int
    step_text: StepText | None = None

    @property
    def request_id(self) -> str:
        return self.path.controller.request_id

    def on_logits(self, seq, row):
        return [seq]

    def on_sampled(self, seq, out) -> None:
        self.path.controller.on_lookahead_token(self, out)


class BranchEvents(Protocol):
    """What a branch tells its speculation (`runtime.search.speculation.Speculation`)."""

    @property
    def request_id(self) -> str: ...

    def on_token(self, lineage: "SearchPath | Branch", out: SampleOutput) -> None: ...


@dataclass(eq=False)
class Branch:
    """A speculative fork (`runtime.search.speculation`) at token index `start` (a lineage's step's
    end) decoding as that lineage's child with seed key `seed_key`."""

    speculation: BranchEvents
    seed_key: tuple[int, ...]
    start: int
    seq: Sequence
    sampling: SamplingState
    potential: int  # its parent's, at the step's end it forked from
    ahead: list[StepAhead]
    step_text: StepText | None = None

    @property
    def request_id(self) -> str:
        return self.speculation.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.seq.token_ids) - self.start

    def child_seed_key(self, ordinal: int, at: int) -> tuple[int, ...]:
        return self.seed_key + (at, ordinal)  # as its child's will be (SearchPath.child_seed_key)

    def on_logits(self, seq, row):
        return [seq]

    def on_sampled(self, seq, out) -> None:
        self.speculation.on_token(self, out)


Lineage = SearchPath | Branch  # a path or a speculative branch below it


@dataclass(eq=False)
class SearchRoot:
    """The prompt's sequence: prefilled once, then forked into the initial paths."""

    controller: PathEvents

    @property
    def request_id(self) -> str:
        return self.controller.request_id

    def on_logits(self, seq, row):
        return self.controller.spawn(seq)

    def on_sampled(self, seq, out) -> None:
        raise AssertionError("a search's prompt is never sampled: its logits go to the paths it forks")
