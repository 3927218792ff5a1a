"""A reward model scoring from its own paged KV store with its own prefix cache.

A path's verifier input for step k extends its input for step k-1 (the problem and earlier steps come
first), so each scoring sequence is admitted against the prefix cache and only the new step's
tokens (from the last shared block on) are prefilled. Sibling paths share their common prefix the
same way. Sequences are prefill-only: the family's head reads the final hidden states at the new
step's read position, and the sequence's blocks go back to the cache at once.

Jobs from every search are batched into one forward pass per engine step, within a token budget.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from runtime.model.model_runner import ModelRunner
from runtime.model.recurrent import recurrent_states
from runtime.model.float_layers import float_layers
from runtime.model.row_padding import padding_for
from runtime.verify.host import ScoreClient, VerifierHost
from runtime.verify.scoring import CalculatorScorer, ConfidenceScorer, JudgeScorer, ScoreBatch, higher
from runtime.verify.verifiers.judge import JudgeVerifier
from scheduler.kv_manager import KVManager
from scheduler.scheduler import ScheduledSequence
from scheduler.sequence import Sequence
from storage.block_pool import BlockPool
from storage.kv_cache import KVCache, KVShape, kv_shape_of

log = logging.getLogger("ponder.runtime")


@dataclass(eq=False)
class ScoreJob:
    controller: object
    path: object
    seq: Sequence
    read_position: int  # absolute position whose hidden state scores the newest unit
    batch: ScoreBatch
    ahead: tuple[str, int] | None = None  # (the path's next unit, its read position) when scored along


@dataclass(frozen=True, eq=False)
class StoreScore:
    """A score read in a step of the store, which the engine hands to its search (`deliver`)."""

    job: ScoreJob
    score: float
    prefilled: int  # tokens computed for it
    cached: int  # tokens found in the store's prefix cache
    score_ahead: float | None  # its path's next unit's, read along (LookAhead verification)

    @property
    def request_id(self) -> str:
        return self.job.controller.request_id

    def deliver(self) -> None:
        """To the search, unless it ended meanwhile; the last score of a verification lets it go on."""
        job = self.job
        if job.controller.is_finished:
            return
        if self.score_ahead is not None:
            job.controller.on_next_score(job.path, job.ahead[0], self.score_ahead)
        job.batch.scored(job.path, self.score, self.prefilled, self.cached)


class VerifierStore:
    is_free = False  # a reward model's forwards: not started past a search's deadline
    reads_text = True  # the steps' text alone: it scores given responses too (/v1/rewards)
    outranks = staticmethod(higher)

    @staticmethod
    def score_of(logprobs) -> float | None:
        """None: a reward model reads the step's text, which only verifying gives it."""
        return None

    def __init__(self, name: str, verifier, shape: KVShape, num_blocks: int, max_batched_tokens: int,
                 host: VerifierHost, *, max_model_len: int, batch_invariant: bool | str) -> None:
        self.name = name
        self.verifier = verifier
        self.host = host
        model = verifier.model
        self.device = next(model.parameters()).device
        self.pool = BlockPool(num_blocks, shape.block_size)
        states = recurrent_states(model, shape.block_size)
        self.kv = KVManager(self.pool, extra_key=f"verifier:{name}".encode(), states=states)
        self.cache = KVCache(shape, num_blocks, next(model.parameters()).dtype, self.device, scratch=True)
        if self.device.type == "cpu":  # float layers in ponder's kernel, as a float generator's: no padding
            log.info("reward model %s: %s", name, float_layers(model).describe())
        padding = padding_for(model, batch_invariant, max_batched_tokens, max_model_len=max_model_len,
                              block_size=shape.block_size)
        self.runner = ModelRunner(model, self.cache, padding, states)
        self.max_batched_tokens = max_batched_tokens
        self.prefill_token_cap: int | None = None  # a tighter per-step budget (roofline KV split)
        self.last_input_tokens = 0  # mean verifier input of the latest submission (the load, for the split)
        self.queue: deque[ScoreJob] = deque()
        self.tokens_prefilled = 0
        self.tokens_cached = 0
        self.scores_ahead = 0  # next-step scores read along with a step's (LookAhead verification)

    @property
    def max_input_tokens(self) -> int:
        """The most tokens one input may have: what its own pool holds."""
        return self.pool.num_blocks * self.pool.block_size

    def input_tokens(self, question: str, steps: list[str]) -> int:
        """The tokens of its input about the last of `steps`."""
        return len(self.verifier.build_inputs(question, steps)[-1].token_ids)

    @property
    def has_work(self) -> bool:
        return bool(self.queue)

    def cap_prefill_tokens(self, tokens: int | None) -> None:
        """Prefill at most `tokens` per step (never below one job, as with `max_batched_tokens`);
        None removes the cap."""
        if tokens is not None and tokens < 1:
            raise ValueError(f"a prefill token cap must be >= 1, got {tokens}")
        self.prefill_token_cap = tokens

    @property
    def step_token_budget(self) -> int:
        if self.prefill_token_cap is None:
            return self.max_batched_tokens
        return min(self.max_batched_tokens, self.prefill_token_cap)

    def submit(self, controller: ScoreClient, paths) -> None:
        """Queue the newest unit of each path; the controller hears back through on_score/score_done
        when the engine delivers the scores `step` read."""
        controller.expect_scores()
        batch = ScoreBatch(controller, len(paths), time.perf_counter(), self.host.observe_verifier)
        capacity = self.pool.num_blocks * self.pool.block_size
        for path in paths:
            units = path.scoring_units()
            last = self.verifier.build_inputs(controller.question, units)[-1]
            if len(last.token_ids) > capacity:
                self.host.fail_request(controller.request_id, f"the verifier input of {len(last.token_ids)} "
                                         f"tokens exceeds the {self.name} verifier's KV store")
                return
            read = last.read_positions[-1]
            ahead = None
            unit = controller.lookahead_unit(path)
            if unit is not None:  # LookAhead verification: the next step in the same sequence
                both = self.verifier.build_inputs(controller.question, units + [unit])[-1]
                # Only where the current score is read at the same position after the same tokens
                # (a per-step reward model), so the next step cannot change it.
                if (len(both.read_positions) >= 2 and both.read_positions[-2] == read
                        and list(both.token_ids[:read + 1]) == list(last.token_ids[:read + 1])
                        and len(both.token_ids) <= capacity):
                    last, ahead = both, (unit, both.read_positions[-1])
            seq = Sequence(list(last.token_ids))
            self.queue.append(ScoreJob(controller, path, seq, read, batch, ahead))
        if paths:
            self.last_input_tokens = sum(len(job.seq.token_ids) for job in list(self.queue)[-len(paths):]) // len(paths)

    def step(self, token_cap: int | None = None) -> list[StoreScore]:
        """Prefill as many queued jobs as fit, read their scores, release their blocks to the cache;
        `token_cap`: a tighter budget for this step (a search's deadline: runtime.search.pacing).
        Returns the scores, in the order of their jobs, for the engine to hand to their searches."""
        jobs: list[ScoreJob] = []
        budget = self.step_token_budget if token_cap is None else min(self.step_token_budget, token_cap)
        while self.queue:
            job = self.queue[0]
            if job.controller.is_finished:
                self.queue.popleft()  # its search was aborted
                continue
            if jobs and len(job.seq.token_ids) > budget:
                break
            if not self.kv.admit(job.seq, len(job.seq.token_ids), max_cached_tokens=job.read_position):
                if jobs:
                    break
                self.host.fail_request(job.controller.request_id, "the verifier's KV store cannot hold "
                                         "one scoring sequence")
                continue
            self.queue.popleft()
            jobs.append(job)
            budget -= job.seq.num_uncomputed_tokens
        if not jobs:
            return []
        scheduled = [ScheduledSequence(job.seq, job.seq.num_uncomputed_tokens) for job in jobs]
        reads = [(i, job.read_position) for i, job in enumerate(jobs)]
        reads += [(i, job.ahead[1]) for i, job in enumerate(jobs) if job.ahead is not None]
        hidden = self.runner.hidden_states(scheduled, [], self.runner.padded_rows(reads))
        with torch.inference_mode():
            scores = self.verifier.read_scores(hidden).float().tolist()[:len(reads)]
        ahead_scores = iter(scores[len(jobs):])
        read: list[StoreScore] = []
        for job, score in zip(jobs, scores):
            score_ahead = None
            if job.ahead is not None:
                score_ahead = next(ahead_scores)
                self.scores_ahead += 1
            cached = job.seq.num_computed_tokens
            computed = len(job.seq.token_ids) - cached
            self.kv.commit_computed(job.seq, len(job.seq.token_ids))
            self.kv.free(job.seq)
            self.tokens_prefilled += computed
            self.tokens_cached += cached
            read.append(StoreScore(job, score, computed, cached, score_ahead))
        return read

    def abort(self, controller) -> None:
        self.queue = deque(job for job in self.queue if job.controller is not controller)


def build_scorers(host, model, tokenizer, config, reward_models: dict[str, tuple[object, int]],
                  padding) -> tuple[dict[str, object], list[VerifierStore]]:
    """Every verifier a search may name: the free ones, the judge (where the tokenizer has distinct
    Yes/No tokens) and each reward model with its own KV store of `blocks` blocks, as
    ({name: scorer}, [the stores]). `host` is the engine; `padding`: whether the generator is served
    padded for batch invariance (its reward models are served likewise)."""

    scorers: dict[str, object] = {"confidence": ConfidenceScorer(), "calculator": CalculatorScorer(tokenizer)}
    try:
        scorers["judge"] = JudgeScorer(host, JudgeVerifier(model, tokenizer))
    except ValueError as exc:  # a tokenizer with no distinct Yes/No tokens cannot judge
        log.warning("the judge verifier is unavailable for this model: %s", exc)
    stores = []
    for name, (verifier, num_blocks) in reward_models.items():
        if name in scorers:
            raise ValueError(f"verifier name {name!r} is built in; choose another name")
        store = VerifierStore(name, verifier, kv_shape_of(verifier.model.config, config.block_size), num_blocks,
                              config.max_num_batched_tokens, host, max_model_len=config.max_model_len,
                              batch_invariant=config.batch_invariant if padding else False)
        scorers[name] = store
        stores.append(store)
    return scorers, stores
