"""A step's verification, between its last token and its settling: which paths are scored (every
`granularity`-th step, and whenever a path finished), the scores already known from a look-ahead
verification, roll-out look-ahead before scoring (`runtime.search.ahead.Rollouts`), and the scores
coming in. A free verifier scores at once; a model's scores (`Verify` in the plan) arrive in later
steps, through the search's `ScoreClient` methods, and the step settles once all arrived. A model's
verification still running at the deadline is abandoned, its scores so far taken back (`abandon`).

It owns the verification's state and counters, and the phase clock (seconds generating and verifying);
the controller owns the step's paths and settles them (`settle`, given)."""

from __future__ import annotations

import time
from typing import Callable, Protocol

from runtime.search.aggregate import normalize_step
from runtime.search.ahead import RolloutPort, Rollouts
from runtime.search.deadline import Deadline
from runtime.search.host import Verifier
from runtime.search.paths import SearchPath


class VerificationPort(RolloutPort, Protocol):
    """What verification reads of its search (`runtime.search.controller.SearchController`, which its
    verifier scores for: the `ScoreClient`)."""

    verifier: Verifier
    deadline: Deadline
    is_finished: bool


class Verification:
    def __init__(self, search: VerificationPort, settle: Callable[[], None]) -> None:
        self.search = search
        self.settle = settle  # the step's scores are all in (or given up): the search settles it
        self.rollouts = Rollouts(search, self._submit)
        self.verify_now = False  # whether the step being settled is a verified one (granularity)
        self.to_verify: list[SearchPath] = []
        self.pending = 0  # batches of a model's scores on their way
        self.scores_before: dict[SearchPath, int] = {}  # per path under verification: its scores before it
        self.scores_ahead = 0  # step scores taken from a look-ahead verification
        self.stats = dict(verifier_tokens_prefilled=0, verifier_calls=0, prefix_hit_tokens=0,
                          seconds_generating=0.0, seconds_verifying=0.0)
        self._phase_started = time.perf_counter()

    def start(self, stepped: list[SearchPath], step_index: int, uses_verifier: bool) -> None:
        """Every path of step `step_index` has ended it (`stepped`): score those due, then settle."""
        search, deadline = self.search.search, self.search.deadline
        now = time.perf_counter()
        self.stats["seconds_generating"] += now - self._phase_started
        self._phase_started = now
        self.verify_now = step_index % search.granularity == 0 or step_index >= search.max_steps
        to_score = [p for p in stepped if self.verify_now or p.is_done] if uses_verifier else []
        if deadline.passed():
            deadline.cut_step(bool(to_score) and self.search.verifier.is_free)
            if to_score and not deadline.cut_step_verified:
                self.settle()
                return
        known = []
        for path in to_score:
            unit_ids = path.seq.token_ids[path.chunk_start:path.step_end]
            unit = self.search.host.tokenizer.decode(unit_ids, skip_special_tokens=True)
            path.chunks.append(normalize_step(unit, search.step_delimiter))
            if path.next_score is not None and path.next_score[0] == path.chunks[-1]:
                known.append((path, path.next_score[1]))
            path.next_score = None
        for path, score in known:  # scored ahead, in the previous step's verification
            self.on_score(path, score)
            self.scores_ahead += 1
        scored = {id(path) for path, _ in known}
        self.to_verify = [p for p in to_score if id(p) not in scored]
        if not self.to_verify:
            self.settle()
            return
        rollouts = [p for p in self.to_verify if not p.is_done] if search.lookahead else []
        if rollouts and step_index < search.max_steps:
            self.rollouts.start(rollouts)
            return
        self._submit()

    def _submit(self) -> None:
        """A free verifier scores at once; a model's scores (`Verify`) arrive in later steps (`on_score`)."""
        verifier = self.search.verifier
        if self.to_verify:
            self.stats["verifier_calls"] += 1
            self.scores_before = {path: len(path.step_scores) for path in self.to_verify}
            if not verifier.is_free:
                self.search.plan.verify(self.to_verify)
                return
            verifier.submit(self.search, self.to_verify)
        if self.pending == 0 and not self.search.is_finished:
            self.settle()

    def settled(self) -> None:
        """The step settles: its verifying phase ends."""
        now = time.perf_counter()
        self.stats["seconds_verifying"] += now - self._phase_started
        self._phase_started = now

    # -- what the verifier tells it (the controller's `ScoreClient` methods) ----------------------
    def on_score(self, path: SearchPath, score: float, prefilled: int = 0, cached: int = 0) -> None:
        path.step_scores.append(float(score))
        path.chunk_logprobs = []
        path.lookahead_units, path.lookahead_logprobs = [], []
        path.chunk_start = path.step_end
        self.stats["verifier_tokens_prefilled"] += prefilled
        self.stats["prefix_hit_tokens"] += cached

    def expect_scores(self) -> None:
        self.pending += 1

    def score_done(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.settle()

    def on_lookahead_token(self, run, out) -> None:
        self.rollouts.on_token(run, out)

    def sequences(self) -> list:
        """The roll-outs' sequences still held."""
        return self.rollouts.sequences()

    @property
    def is_pending(self) -> bool:
        """Whether a model's scores are still on their way."""
        return self.pending > 0

    def abandon(self) -> None:
        """The deadline passed with a model's scores on their way: they are not waited for, the scores
        that came are taken back, and the step cut short counts as not verified (the caller settles)."""
        self.search.plan.abandon_scoring()
        for path, count in self.scores_before.items():
            del path.step_scores[count:]
        self.pending = 0
        self.search.deadline.cut_step(False)
