"""How the search engine scores steps with each kind of verifier.

- `confidence`: the generator's own mean token log-probability of the unit, kept while sampling.
- `judge`: the generator (or another causal LM served by the same engine) asked whether the latest
  step is correct. Each question is a prefill-only sequence in the engine's paged store, so its KV
  shares the prefix cache: the problem and earlier steps are found cached, and sibling paths share
  their common prefix; paths asking the very same question share one sequence. The score is
  P(Yes) / (P(Yes) + P(No)) at the last position.
- a process or outcome reward model loaded from the config: scored from its own paged store with
  its own prefix cache (`runtime.search.verifier_store.VerifierStore`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from runtime.search.verifiers.confidence import confidence_from_logprobs
from runtime.search.verifiers.judge import JudgeVerifier
from scheduler.sequence import Sequence


class ConfidenceScorer:
    name = "confidence"

    def submit(self, controller, paths) -> None:
        for path in paths:
            controller.on_score(path, confidence_from_logprobs(path.chunk_logprobs + path.lookahead_logprobs))


@dataclass(eq=False)
class ScoreBatch:
    """The scores one verification asked for; the controller hears once all of them arrived."""

    controller: object
    remaining: int
    started: float

    def scored(self, engine, path, score: float, prefilled: int, cached: int) -> None:
        self.controller.on_score(path, score, prefilled=prefilled, cached=cached)
        self.remaining -= 1
        if self.remaining == 0:
            engine.observe_verifier(time.perf_counter() - self.started)
            self.controller.score_done()


@dataclass(eq=False)
class _ScoreJob:
    scorer: "JudgeScorer"
    batch: ScoreBatch
    paths: list  # every path of the verification asking this very question

    @property
    def request_id(self) -> str:
        return self.batch.controller.request_id

    def on_logits(self, engine, seq: Sequence, row: torch.Tensor):
        yes = torch.logsumexp(row[list(self.scorer.judge.yes_token_ids)], dim=-1)
        no = torch.logsumexp(row[list(self.scorer.judge.no_token_ids)], dim=-1)
        score = float(torch.sigmoid(yes - no))
        cached = seq.num_cached_tokens
        engine.release_sequence(seq)
        first, *same = self.paths
        self.batch.scored(engine, first, score, len(seq.token_ids) - cached, cached)
        for path in same:  # asked once: nothing was prefilled for it, all of it was known
            self.batch.scored(engine, path, score, 0, len(seq.token_ids))
        return []


class JudgeScorer:
    name = "judge"

    def __init__(self, engine, judge: JudgeVerifier) -> None:
        self.engine = engine
        self.judge = judge

    def submit(self, controller, paths) -> None:
        """One question per distinct text asked: paths whose steps read the same (siblings that
        sampled the same step) share its sequence and its score, which a second sequence would
        only compute again in the same batch, before the first one's blocks are in the cache."""
        controller.pending_scores += 1
        batch = ScoreBatch(controller, len(paths), time.perf_counter())
        jobs: dict[tuple[int, ...], _ScoreJob] = {}
        for path in paths:
            units = path.scoring_units()
            inputs = self.judge.build_input(controller.question, units, len(units))
            if inputs.token_ids in jobs:
                jobs[inputs.token_ids].paths.append(path)
            else:
                jobs[inputs.token_ids] = _ScoreJob(self, batch, [path])
        for token_ids, job in jobs.items():
            self.engine.add_scoring_sequence(Sequence(list(token_ids), owner=job), controller)
