"""Scoring given responses (`POST /v1/rewards`) with the very scorers a search verifies its paths with.

A candidate of k steps is shown to the scorer as k paths, the i-th holding the candidate's first i
steps, just as a search's path holds its steps when its i-th is verified; the scorer scores each
path's newest step by its own code (the judge's question, the reward model's input and read
position), and the scores come back through `on_score` as a search's do.

`confidence` and `calculator` cannot score given text: they rank by the generator's log-probabilities
of the tokens it sampled for the step, kept while sampling, which a given response has none of.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False)
class GivenPath:
    """A candidate's first steps, as a search's path shows them to a scorer."""

    candidate: int
    chunks: list[str]

    def scoring_units(self) -> list[str]:
        return self.chunks


class RewardScoring:
    """Stands where a search's controller stands for a scorer: it hears each path's score
    (`on_score`) and, from a scorer with a model, when a batch of them has all arrived (`score_done`).
    `on_done`: called once every step of every candidate has its score."""

    def __init__(self, request_id: str, question: str, candidates: list[list[str]],
                 on_done: Callable[["RewardScoring"], None]) -> None:
        self.request_id = request_id
        self.question = question
        self.candidates = candidates
        self.on_done = on_done
        self.step_scores: list[list[float | None]] = [[None] * len(steps) for steps in candidates]
        self.pending_scores = 0
        self.is_finished = False
        self.input_tokens = 0
        self.cached_tokens = 0

    @staticmethod
    def can_score(scorer) -> bool:
        """Whether `scorer` reads the steps' text alone (a reward model, the judge), not logprobs of sampling."""
        return scorer.reads_text

    def input_lengths(self, scorer) -> list[int]:
        """Per candidate, the tokens of the longest input the scorer reads about it: its last step's."""
        return [scorer.input_tokens(self.question, steps) for steps in self.candidates]

    def start(self, scorer) -> None:
        """Submit every step of every candidate in one verification; `on_done` once all are scored."""
        paths = [GivenPath(c, steps[:k]) for c, steps in enumerate(self.candidates) for k in range(1, len(steps) + 1)]
        scorer.submit(self, paths)

    def cancel(self) -> None:
        """Aborted: a score still on its way is not taken."""
        self.is_finished = True

    def sequences(self) -> list:
        """Sequences it holds itself (for aborts): none; its judge questions are the engine's `scoring`."""
        return []

    # -- what the scorers call, as on a search's controller (runtime.verify.host.ScoreClient) -------
    def expect_scores(self) -> None:
        self.pending_scores += 1

    @staticmethod
    def lookahead_unit(path: GivenPath) -> None:
        """None: a given response has no step ahead of the one scored."""
        return None

    def on_next_score(self, path: GivenPath, unit: str, score: float) -> None:
        raise AssertionError("a given response has no step ahead: no scorer reads one (lookahead_unit is None)")

    def on_score(self, path: GivenPath, score: float, prefilled: int = 0, cached: int = 0) -> None:
        self.step_scores[path.candidate][len(path.chunks) - 1] = float(score)
        self.input_tokens += prefilled + cached
        self.cached_tokens += cached

    def score_done(self) -> None:
        self.pending_scores -= 1
        if self.pending_scores == 0:
            self.is_finished = True
            self.on_done(self)
