"""How the search engine scores steps with each kind of verifier.

- `confidence`: the generator's own mean token log-probability of the unit, kept while sampling.
- `calculator`: a calculator checks the arithmetic the path has written so far, grounded in the
  question (the last user message, the prompt text, or the decoded prompt tokens); the verdict's tier,
  ordered within by the unit's confidence (`runtime.verify.verifiers.calculator`). Free as well.
- `judge`: the generator (or another causal LM served by the same engine) asked whether the latest
  step is correct. Each question is a prefill-only sequence in the engine's paged store, so its KV
  shares the prefix cache: the problem and earlier steps are found cached, and sibling paths share
  their common prefix; paths asking the very same question share one sequence. A question stays
  parked after its score is read, until the search's next verification: the next question about the
  same path repeats it up to where its own suffix began, and is forked from it there, so not even
  the partly filled block before the new step is prefilled again. The score is
  P(Yes) / (P(Yes) + P(No)) at the last position.
- a process or outcome reward model loaded from the config: scored from its own paged store with
  its own prefix cache (`runtime.verify.verifier_store.VerifierStore`).
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.verify.host import GroundedClient, JudgeHost, ScoreClient
from runtime.verify.verifiers import calculator
from runtime.verify.verifiers.confidence import confidence_from_logprobs
from runtime.verify.verifiers.judge import JudgeVerifier
from scheduler.sequence import Sequence


def unit_confidence(path) -> float:
    """The confidence of a path's unit being verified: its sampled tokens' and its look-ahead's."""
    return confidence_from_logprobs(path.chunk_logprobs + path.lookahead_logprobs)


def higher(score: float, anchor_score: float) -> bool:
    """The greedy anchor's margin where a verifier has none of its own: a strictly higher score."""
    return score > anchor_score


class ConfidenceScorer:
    name = "confidence"
    is_free = True  # scores from logprobs already at hand: still worth taking past a search's deadline
    reads_text = False  # the logprobs sampled for the step: a given response (/v1/rewards) has none
    outranks = staticmethod(higher)

    def submit(self, controller: ScoreClient, paths) -> None:
        for path in paths:
            controller.on_score(path, unit_confidence(path))

    @staticmethod
    def score_of(logprobs) -> float | None:
        """The score `submit` gives a unit of these sampled tokens' log-probabilities (no look-ahead):
        speculation reads it for a step decoded ahead, before any path exists to score."""
        return confidence_from_logprobs(logprobs)


class CalculatorScorer:
    name = "calculator"
    is_free = True  # no model: a regular expression and exact arithmetic over the path's text
    reads_text = False  # orders a tier by the step's sampled logprobs, which a given response has none of

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer  # decodes a prompt given as token ids, whose numbers ground the operands

    @staticmethod
    def outranks(score: float, anchor_score: float) -> bool:
        """The greedy anchor's margin (runtime.search.anchor): a candidate must reach a higher tier."""
        return calculator.tier_of_score(score) > calculator.tier_of_score(anchor_score)

    @staticmethod
    def score_of(logprobs) -> float | None:
        """None: the calculator reads the path's text, which only verifying has."""
        return None

    def submit(self, controller: GroundedClient, paths) -> None:
        question = self.question_of(controller)
        for path in paths:
            controller.on_score(path, calculator.step_score(path.scoring_units(), unit_confidence(path), question))

    def question_of(self, controller: GroundedClient) -> str:
        """The text whose numbers ground the calculator's operands: the search's question, or, for a
        prompt given as token ids (no text), the prompt decoded."""
        if controller.question:
            return controller.question
        return self.tokenizer.decode(controller.prompt_ids, skip_special_tokens=True)


@dataclass(eq=False)
class ScoreBatch:
    """The scores one verification asked for; the controller hears once all of them arrived, and
    `observe` how long they took."""

    controller: object
    remaining: int
    started: float
    observe: Callable[[float], None]

    def scored(self, path, score: float, prefilled: int, cached: int) -> None:
        self.controller.on_score(path, score, prefilled=prefilled, cached=cached)
        self.remaining -= 1
        if self.remaining == 0:
            self.observe(time.perf_counter() - self.started)
            self.controller.score_done()


@dataclass(eq=False)
class _ScoreJob:
    scorer: "JudgeScorer"
    batch: ScoreBatch
    paths: list  # every path of the verification asking this very question

    @property
    def request_id(self) -> str:
        return self.batch.controller.request_id

    def on_logits(self, seq: Sequence, row: torch.Tensor):
        yes = torch.logsumexp(row[list(self.scorer.judge.yes_token_ids)], dim=-1)
        no = torch.logsumexp(row[list(self.scorer.judge.no_token_ids)], dim=-1)
        score = float(torch.sigmoid(yes - no))
        cached = seq.num_cached_tokens
        self.scorer.host.park_sequence(seq)  # kept until the next verification of its search forks from it
        self.scorer.kept.setdefault(self.batch.controller, []).append(seq)
        first, *same = self.paths
        self.batch.scored(first, score, len(seq.token_ids) - cached, cached)
        for path in same:  # asked once: nothing was prefilled for it, all of it was known
            self.batch.scored(path, score, 0, len(seq.token_ids))
        return []

    def on_sampled(self, seq: Sequence, out) -> None:
        raise AssertionError("a judge's question is only prefilled: its score is read from its logits")


class JudgeScorer:
    name = "judge"
    is_free = False  # a model's questions, prefilled in later steps: not started past a search's deadline
    reads_text = True  # the steps' text alone: it scores given responses too (/v1/rewards)
    max_input_tokens = None  # its questions run in the engine's own pool: the model's context is the limit
    outranks = staticmethod(higher)

    @staticmethod
    def score_of(logprobs) -> float | None:
        """None: the judge reads the step's text, which only verifying asks it about."""
        return None

    def __init__(self, host: JudgeHost, judge: JudgeVerifier) -> None:
        self.host = host
        self.judge = judge
        # Each search's questions of its latest verification, parked with their blocks: the next
        # question about a path begins with its previous one up to where that one's suffix began.
        self.kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def input_tokens(self, question: str, steps: list[str]) -> int:
        """The tokens of its question about the last of `steps`."""
        return len(self.judge.build_input(question, steps, len(steps)).token_ids)

    def submit(self, controller: ScoreClient, paths) -> None:
        """One question per distinct text asked: paths whose steps read the same (siblings that
        sampled the same step) share its sequence and its score, which a second sequence would
        only compute again in the same batch, before the first one's blocks are in the cache."""
        controller.expect_scores()
        batch = ScoreBatch(controller, len(paths), time.perf_counter(), self.host.observe_verifier)
        jobs: dict[tuple[int, ...], _ScoreJob] = {}
        for path in paths:
            units = path.scoring_units()
            inputs = self.judge.build_input(controller.question, units, len(units))
            if inputs.token_ids in jobs:
                jobs[inputs.token_ids].paths.append(path)
            else:
                jobs[inputs.token_ids] = _ScoreJob(self, batch, [path])
        kept = self.kept.pop(controller, [])
        for token_ids, job in jobs.items():
            parent, num_shared = longest_shared(kept, token_ids)
            seq = Sequence(list(token_ids), owner=job)
            if num_shared > 1:
                # Its KV up to the last shared token, the partial block too (the prefix cache
                # matches whole blocks only): only the rest is prefilled.
                self.host.fork_prompt(parent, seq, num_shared)
                self.host.resume_sequence(seq)
            else:
                self.host.add_sequence(seq)
        for seq in kept:
            self.host.release_sequence(seq)


def longest_shared(seqs: list[Sequence], token_ids: tuple[int, ...]) -> tuple[Sequence | None, int]:
    """The sequence whose tokens begin `token_ids` furthest, and how many tokens they share (the
    earliest such sequence on a tie); (None, 0) if none shares any."""
    best, most = None, 0
    for seq in seqs:
        shared = len(os.path.commonprefix([seq.token_ids, list(token_ids)]))
        if shared > most:
            best, most = seq, shared
    return best, most
