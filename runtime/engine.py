"""The engine: requests in, one scheduled model step at a time, wire messages out.

A step reads as three calls: plan (the step's work asks for its changes, then the scheduler plans),
execute (the runner), update (sampling; each row's owner hears its logits and tokens).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from runtime.grammar.matcher import Grammar, advance, step_masks
from runtime.kv.beam_groups import StepPlanner
from runtime.kv.kv_tiers import TieredPrefixCache
from runtime.kv.layer_offload import LayerwiseResidency, logical_blocks
from runtime.kv.residency import Residency
from runtime.kv.window_split import split_pools
from runtime.model.detokenizer import eos_token_ids
from runtime.model.model_runner import ModelRunner
from runtime.model.quantize import Quantized
from runtime.model.recurrent import recurrent_states
from runtime.requests.admission import admit, check_granularity, thinking_start
from runtime.requests.grammar_gate import GrammarGate
from runtime.requests.plain import PlainRequests
from runtime.grammar.thinking import ThinkingMarkers
from runtime.wire.protocol import Accepted, FromRuntime, GenerateRequest, RequestError, RewardRequest, RuntimeStats
from runtime.model.row_padding import padding_for
from runtime.wire.reasoning import opens_thinking, reasoning_format_of
from runtime.requests.state import InvalidRequest, RequestState, answer_form_of
from runtime.model.sampler import sample
from runtime.search.controller import SearchController
from runtime.search.pacing import StepPacer
from runtime.steps.work import StepWork
from runtime.verify.verifier_store import build_scorers
from scheduler.kv_manager import KVManager
from scheduler.scheduler import Scheduler, SchedulerOutput
from scheduler.step_cost import StepCost
from scheduler.sequence import Sequence
from storage.block_pool import BlockPool
from storage.kv_cache import KVCache, KVShape, kv_shape_of
from storage.piece_transfers import PieceLost
from storage.tiers import TierChain


PROMPT_TAIL_TOKENS = 16  # where a template opens a thinking block: among the generation prompt's last tokens

log = logging.getLogger("ponder.runtime")


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_cache: bool = True
    recurrent_snapshot_bytes: int = 256 << 20  # linear-attention states kept at block boundaries
    policy: str = "lbs"  # how a search step's paths share the pool (runtime.kv.beam_groups)
    kv_granularity: str = "block"  # head: a lone request over the pool streams head-wise (runtime.kv.headwise)
    speculative_extension: bool | str = True  # auto: the rows the step-cost model says pay (scheduler.step_cost)
    batch_invariant: bool | str = "auto"  # pad steps so each row's bits are its own (row_padding.padding_for)
    invariance_cache: dict | None = None  # the model's identity: the probe's verdict is kept in the start-up cache


class Engine:
    """The loop, and what it owns: the compute pool, its queues, the plain requests, the outbox; the
    searches, scorers and rewards requests ride on it behind one owner (`runtime.steps.work.StepWork`).
    Nothing below it holds the engine: each part declares the port it needs (runtime.steps.host,
    runtime.requests.host, runtime.search.host, runtime.verify.host, runtime.kv.host), which the engine
    satisfies; a search asks for every change in its plan (runtime.search.plan), which the step's work
    carries out through that port."""

    def __init__(self, model, tokenizer, config: EngineConfig, model_key: bytes = b"", *,
                 quantized: Quantized | None = None, kv_split=None, tiers: TierChain | None = None,
                 reward_models: dict[str, tuple[object, int]] | None = None) -> None:
        """`quantized`: what the `quantize` setting made of the model's layers (float weights when
        not given); `kv_split`: the roofline KV split (runtime.kv.kv_split), or None for a static one;
        `tiers`: host and disk tiers below the compute pool (their payload: runtime.kv.residency.tier_payload),
        over which the prefix cache extends (runtime.kv.kv_tiers), or under `token` the paths' KV may
        outgrow the compute budget, its layers over it reloaded for every token (runtime.kv.layer_offload);
        the head-wise residency owns them; `reward_models`: name -> (a loaded reward-model verifier, the
        blocks of its own KV store), each usable as `search.verifier = name`."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = next(model.parameters()).device
        head = model.get_output_embeddings()  # a quantized head's weight is packed: ask its out_features
        self.vocab_size = getattr(head, "out_features", None) or head.weight.shape[0]
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.planner = StepPlanner(self, config.policy, config.max_num_seqs)
        self.pacer = StepPacer(config.block_size)  # steps short enough for searches' deadlines
        self.step_cost = StepCost()  # what a decode step costs: fixed, and a row (speculation's `auto`)
        self.speculation_pays: bool | None = None  # the step-cost model's latest verdict, as logged
        self.model_key = model_key
        self.padding = padding_for(model, config.batch_invariant, config.max_num_batched_tokens, config.max_num_seqs,
                                   max_model_len=config.max_model_len, block_size=config.block_size,
                                   cache=config.invariance_cache)
        dtype = next(model.parameters()).dtype
        shape = kv_shape_of(model.config, config.block_size)
        self._build_pool(shape, dtype, config.num_blocks if tiers is None or config.policy != "token"
                         else logical_blocks(tiers, shape, dtype, config), tiers is not None)
        self.streamed = check_granularity(self, config, model_key)  # head-wise, or None
        below: Residency | None = None  # the tiers' residency (a head-wise one owns it)
        if tiers is not None:
            below = LayerwiseResidency(self.cache, self.pool, tiers, config.num_blocks, model_key) \
                if config.policy == "token" else TieredPrefixCache(self.pool, self.cache, tiers, self.kv.extra_key)
        self.residency: Residency | None = below if self.streamed is None else self.streamed.own(below)
        self.runner.use_residency(self.residency)
        self.quantized = quantized or Quantized("none", "none", 0, "float weights")
        self.kv_split = kv_split
        self.kv_caps = None  # its batch caps for the search load now
        self.plain = PlainRequests(self, tokenizer, self.eos_ids, self.device, config.max_model_len)
        self.requests: dict[str, RequestState] = self.plain.requests
        # Searches, scorers, the rewards route and speculation's slots: one owner, called around the forward pass.
        self.work = StepWork(self, lambda judge_host: build_scorers(judge_host, model, tokenizer, config,
                                                                    reward_models or {}, self.padding),
                             config.max_model_len)
        self.gate = GrammarGate(tokenizer, self.vocab_size, self.eos_ids, self._admit)
        self.reasoning_format = reasoning_format_of(getattr(tokenizer, "chat_template", None))
        self.thinking_markers = ThinkingMarkers.of(tokenizer, self.reasoning_format, self.gate.grammars.num_words
                                                   or (self.vocab_size + 31) // 32)
        self.outbox: list[FromRuntime] = []
        self.stats = {"tokens_prompt": 0, "tokens_generated": 0, "search_requests": {}, "search_paths": 0,
                      "search_steps": 0, "preemptions": 0, "speculative_tokens": {}}

    # -- requests -------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.work.has_work \
            or (self.streamed is not None and self.streamed.has_work) or self.gate.has_work

    def _build_pool(self, shape: KVShape, dtype, num_blocks: int, has_tiers: bool) -> None:
        """The compute tensors, the block pools over them (runtime.kv.window_split), what allocates and runs."""
        config = self.config
        states = recurrent_states(self.model, config.block_size, config.recurrent_snapshot_bytes)
        shape, num_blocks, window, sliding = split_pools(self.model, config, shape, dtype, self.device, num_blocks,
                                                         has_tiers, states is not None)
        self.cache = KVCache(shape, num_blocks, dtype, self.device, scratch=True)
        self.pool = BlockPool(num_blocks, config.block_size)
        self.kv = KVManager(self.pool, extra_key=self.model_key, enable_prefix_cache=config.enable_prefix_cache,
                            states=states, window=window)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.cache, self.padding, states, window=sliding)

    # The step's work, read (its owner changes it): the searches, rewards requests, judge questions, scorers.
    searches = property(lambda self: self.work.searches)
    rewards = property(lambda self: self.work.rewards)
    scoring = property(lambda self: self.work.scoring)
    scorers = property(lambda self: self.work.scorers)
    verifier_stores = property(lambda self: self.work.verifier_stores)

    # The host and disk tiers attached below the compute pool, or None.
    tier_chain = property(lambda self: self.residency.chain if self.residency is not None else None)

    def close(self) -> None:
        """Keep what can outlive the process: every named block goes to the disk tier."""
        self.gate.close()
        if self.residency is not None:
            self.residency.close()

    def add_request(self, request: GenerateRequest) -> list[FromRuntime]:
        """Accepted (or its error) now, or from a later step once its grammar compiled (runtime.requests.grammar_gate)."""
        return self.gate.add(request)

    def _admit(self, request: GenerateRequest, grammar: Grammar | None) -> list[FromRuntime]:
        try:
            ids, max_tokens = admit(request, (self.requests, self.searches), self.tokenizer, self.vocab_size,
                                    self.config, self.kv, self.streamed, verifiers=self.scorers)
            is_open = request.messages is not None and opens_thinking(
                self.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:]), self.reasoning_format)
            thinking = thinking_start(request, is_open, self.reasoning_format, self.thinking_markers,
                                      grammar is not None)
            if request.search is not None:
                self.work.add_search(request, ids, max_tokens, grammar, answer_form_of(request, self.gate.tool_format),
                                     thinking)
                strategy = request.search.strategy
                self.stats["search_requests"][strategy] = self.stats["search_requests"].get(strategy, 0) + 1
            else:
                self.plain.add(request, ids, max_tokens, grammar,
                               streamed=self.kv.num_blocks_for(len(ids) + max_tokens) > self.pool.num_blocks,
                               thinking=thinking)
        except InvalidRequest as err:
            return [err.to_message(request.request_id)]
        self.stats["tokens_prompt"] += len(ids)
        return [Accepted(request_id=request.request_id, prompt_tokens=len(ids), opens_thinking=is_open)]

    def add_rewards(self, request: RewardRequest) -> list[FromRuntime]:
        """Score given responses with a search's verifier (the step's work): a later step sends the Rewarded."""
        return self.work.add_rewards(request)

    def abort(self, request_id: str) -> None:
        self.gate.abort(request_id)
        self.plain.abort(request_id)
        self.work.abort(request_id)

    # -- its ports: sequences (runtime.kv.sequence_host), steps/, requests/ (their host.py); search/ reads --
    def has_waiting(self) -> bool:
        return bool(self.scheduler.waiting)

    def fork_sequence(self, parent: Sequence, child: Sequence, num_tokens: int | None) -> None:
        self.kv.fork(parent, child, num_tokens)
        self.scheduler.hold(child)

    def fork_prompt(self, parent: Sequence, child: Sequence, num_shared: int) -> None:
        """`child` shares the blocks of `parent`'s first `num_shared` tokens (the KV of all but the last
        of them; a partly filled block is copied on first write) and prefills the rest when it runs."""
        assert parent.token_ids[:num_shared] == child.token_ids[:num_shared]
        self.kv.fork_prompt(parent, child, num_shared)
        self.scheduler.hold(child)

    def add_sequence(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def resume_sequence(self, seq: Sequence) -> None:
        self.scheduler.resume(seq)

    def park_sequence(self, seq: Sequence) -> None:
        self.scheduler.park(seq)

    def release_sequence(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self.scheduler.finish(seq)

    def stream_sequence(self, seq: Sequence) -> None:  # (runtime.requests.host, as `readmit`)
        self.streamed.add(seq)

    def readmit(self, seq: Sequence, num_new_tokens: int, max_cached_tokens: int) -> bool:
        return self.kv.readmit(seq, num_new_tokens, max_cached_tokens)

    def prefetch(self, seqs: list[Sequence], reserve: int) -> None:
        self.planner.prefetch(seqs, reserve)

    def emit(self, message: FromRuntime) -> None:
        self.outbox.append(message)

    def has_idle_slot(self) -> bool:
        """Whether a running sequence may decode speculatively taking nothing from other work: nothing
        waits, and the pools have a free block per running sequence."""
        return not self.scheduler.waiting and self.kv.num_free > len(self.scheduler.running)

    def num_idle_slots(self) -> int:
        """How many more sequences may start decoding speculatively: rows the batch has left, with a
        free block for each of them and every running sequence; none while anything waits."""
        if self.scheduler.waiting:
            return 0
        running = len(self.scheduler.running)
        return max(0, min(self.config.max_num_seqs - running, self.kv.num_free - running))

    def speculative_row_cap(self, num_speculative: int) -> int | None:
        """The most speculative rows a search holding `num_speculative` may have in a step (None: as many
        as are idle); under `auto`, those the step-cost model says pay beside the other rows."""
        if self.config.speculative_extension != "auto":
            return None
        cap = self.step_cost.speculative_rows(max(0, len(self.scheduler.running) - num_speculative))
        if (cap != 0) != self.speculation_pays:
            self.speculation_pays = cap != 0
            log.info("speculative extension: %s (%s)", "on" if cap != 0 else "off", self.step_cost.describe())
        return cap

    def observe_speculation(self, saved: int, speculated: int) -> None:
        self.step_cost.observe_speculation(saved, speculated)

    def plan_step(self, seqs: list[Sequence], step_tokens: list[int]) -> list[list[int]]:
        """A search step's paths in groups that fit the pool now, in the order to run them. With the
        roofline split, the load now re-chooses the batch caps first (the decode batch caps a
        group, the verifier's prefill batch caps its tokens per step)."""
        if self.kv_split is not None and seqs:
            live = max(len(seqs), self.work.live_paths())
            context = sum(len(s.token_ids) for s in seqs) // len(seqs) + sum(step_tokens) // (2 * len(seqs))
            verifier_input = max((store.last_input_tokens for store in self.verifier_stores), default=0)
            self.kv_caps = self.kv_split.rechoose(live, context, verifier_input or context + max(step_tokens))
            self.kv_split.apply(self.kv_caps, self.verifier_stores)
        return self.planner.plan(seqs, step_tokens)

    def search_finished(self, controller: SearchController) -> None:
        self.work.forget(controller)
        self.stats["search_paths"] += controller.stats["paths_explored"]
        self.stats["search_steps"] += controller.step_index
        for outcome, count in controller.speculation.tokens.items():
            self.stats["speculative_tokens"][outcome] = self.stats["speculative_tokens"].get(outcome, 0) + count

    def fail_request(self, request_id: str, message: str, status: int = 503, code: str = "kv_cache_exhausted") -> None:
        """End a request that cannot go on (resources, not a bug): free it and tell the client."""
        self.abort(request_id)
        self.outbox.append(RequestError(request_id=request_id, status=status, type="server_error", code=code,
                                        message=message))

    # -- the step: plan -> execute -> update ----------------------------------------------------
    def step(self) -> list[FromRuntime]:
        self.gate.poll(is_idle=not self.scheduler.has_work)
        self.work.check_deadlines()
        plan = self._plan()
        if plan.blocked is not None:  # nothing runs, and the next waiting sequence fits no empty pool
            self.fail_request(plan.blocked.owner.request_id, f"the KV cache is exhausted: a sequence of "
                              f"{len(plan.blocked)} tokens cannot fit in an empty KV pool")
        elif not plan.is_empty and (logits := self._execute(plan)) is not None:
            self._update(plan, logits)
        return self._drain()

    def _plan(self) -> SchedulerOutput:
        """A streamed request's next forward while it has the compute tier to itself, else the
        scheduler's plan, once the step's work (scores, speculation's slots) has asked for its changes."""
        if self.streamed is not None and (plan := self.streamed.schedule()) is not None:
            return plan
        token_cap = self.pacer.token_cap(self.searches.values())  # a search's deadline: shorter steps
        self.work.before_forward(token_cap)
        if self.residency is not None:
            room = max(0, self.config.max_num_seqs - len(self.scheduler.running))
            for seq in list(self.scheduler.waiting)[:min(room, 8)]:
                self.residency.promote_prefix(seq)
        plan = self.scheduler.schedule(token_cap)
        self.stats["preemptions"] += len(plan.preempted) + len(plan.released)
        return plan

    def _execute(self, plan: SchedulerOutput):
        """The forward pass: logits of the rows that sample (then of the rows that score their prompt),
        or None where a lost piece of KV must be computed again first."""
        scored = self.plain.prompt_rows(plan.scheduled)  # prompt logprobs: may undo a cached prefix
        sampled = [i for i, entry in enumerate(plan.scheduled) if entry.completes_prompt]
        try:
            started = time.perf_counter()
            logits = self.runner.execute(plan.scheduled, plan.copies, sampled, scored, plan.window_copies)
        except PieceLost as lost:  # nothing was computed from it: its KV is made whole again
            log.warning("%s; recomputing it", lost)
            self.residency.recover(lost, self.scheduler)
            return None
        if self.streamed is None or self.streamed.seq is None:  # a streamed step's time is its transfers'
            seconds = time.perf_counter() - started
            self.pacer.observe(plan.num_tokens, seconds)
            if plan.num_tokens == len(plan.scheduled):  # a decode step: every row one token
                self.step_cost.observe(plan.num_tokens, seconds)
        if scored:
            self.plain.on_prompt_logits(plan.scheduled, scored, logits[len(sampled):])
            logits = logits[:len(sampled)]
        return logits

    def _update(self, plan: SchedulerOutput, logits) -> None:
        """The computed tokens committed, each sampling row's logits to its owner, its tokens sampled
        and handed out, in order; the searches whose group these tokens ended move on last."""
        sampled = [entry.seq for entry in plan.scheduled if entry.completes_prompt]  # (read before the commit)
        for entry in plan.scheduled:
            self.kv.commit_computed(entry.seq, entry.seq.num_computed_tokens + entry.num_new_tokens)
        rows, seqs = [], []
        for row, seq in enumerate(sampled):
            for target in self.work.on_logits(seq, logits[row]):  # a search's prompt, a judge's question
                rows.append(row)
                seqs.append(target)
        if seqs:
            states = [s.owner.sampling for s in seqs]  # a grammar's rows sample under its mask
            # (every row in order, a decode step's usual case: the logits as they are, not a 3 MB copy a
            # step of 16 rows of a 49k vocabulary)
            picked = logits if rows == list(range(len(logits))) else logits[rows]
            samples = sample(picked, states, [(s.token_ids[:s.num_prompt_tokens], s.output_token_ids)
                                              for s in seqs], step_masks(states, self.vocab_size, self.device))
            advance(states, samples)
            for seq, out in zip(seqs, samples):
                seq.append_token(out.token_id)
                self.stats["tokens_generated"] += 1
                self.work.on_sampled(seq, out)
        self.work.after_step()

    def _drain(self) -> list[FromRuntime]:
        # A request's Accepted precedes its first Delta, which this step may carry
        messages, self.outbox = self.gate.take_admitted() + self.plain.emit() + self.outbox, []
        return messages

    # -- introspection --------------------------------------------------------------------------
    def runtime_stats(self) -> RuntimeStats:
        """The counters since the last call (verifier seconds are handed out once)."""
        pool, tier = self.pool, "gpu" if self.device.type == "cuda" else "cpu"
        return RuntimeStats(
            requests_running=sum(1 for r in self.requests.values() if r.is_forked) + len(self.searches) + len(self.rewards),
            requests_waiting=sum(1 for r in self.requests.values() if not r.is_forked),
            kv_blocks={f"{tier}/used": pool.num_used, f"{tier}/cached": pool.num_cached, f"{tier}/free": pool.num_free,
                       **(self.residency.block_counts() if self.residency else {}), **self.kv.window_counts(tier)},
            kv_transfer_bytes=self.transfer_bytes(),
            prefetch_stall_seconds=self.transfer_stall_seconds(),
            prefix_query_tokens=self.kv.prefix_stats.query_tokens, prefix_hit_tokens=self.kv.prefix_stats.hit_tokens,
            tokens_cached=self.plain.tokens_cached,
            **{key: self.stats[key] for key in ("tokens_prompt", "tokens_generated", "search_paths", "search_steps")},
            search_requests=dict(self.stats["search_requests"]),
            speculative_tokens=dict(self.stats["speculative_tokens"]),
            verifier_seconds=self.work.take_verifier_seconds(),
        )

    def transfer_bytes(self) -> dict[str, int]:  # bytes moved between tiers, {"src/dst": bytes}, since attached
        return self.residency.bytes_moved() if self.residency is not None else {}

    def transfer_stall_seconds(self) -> float:  # seconds the engine loop was blocked on transfers between tiers
        return self.residency.stall_seconds() if self.residency is not None else 0.0

    def check_integrity(self) -> None:
        """AssertionError unless pools and tiers agree with the sequences holding blocks (tests, idle)."""
        self.kv.check_integrity(self.scheduler.running + self.scheduler.parked)
        assert not any(seq.block_table for seq in self.scheduler.waiting), "a waiting sequence holds blocks"
        for store in (s for s in self.verifier_stores if not s.has_work):  # a job frees its blocks when scored
            store.pool.check_integrity([])
        if self.residency is not None:
            self.residency.check_integrity()
        if self.kv.states is not None:
            self.kv.states.check_integrity()
