"""The shared step loop of every search strategy, run on the engine's sequences.

Paths are engine sequences. Each generates one step (until the step delimiter, `max_step_tokens`,
EOS or the length limit) and is then parked with its blocks. When no path of the request is still
generating, the controller verifies (every `granularity`-th step, and whenever a path finished),
lets the strategy settle and expand, and forks the survivors: children share every block of their
parent, so the search never re-prefills a path.

A step's paths run in the groups the engine plans for the compute pool (`runtime.beam_groups`):
one group decodes its whole step while resident, then the next.

Speculative beam extension (FlashTTS): a path done with its step while others of its group still
decode keeps decoding into its next step in the idle slot, until that step ends, the group is done
or the slot is wanted. Verification never sees those tokens (`step_end` marks where the step
ended). A path that survives settling keeps them: they are exactly what it would decode next, from
the same KV and the same sampler, so its next step starts ahead, or is already complete. Its
children fork at `step_end`; a pruned path's speculative tokens are dropped.

LookAhead verification: a reward model scoring a path whose speculative tokens complete its next
step scores both steps in one sequence (the current step's score is read where it always is, so it
cannot see the next step); if the path goes on to that very step, its score is already known.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import msgspec

from runtime.detokenizer import StepText
from runtime.protocol import Delta, Finished, SamplingParams, SearchEvent, SearchParams, SearchSummary, StepScore
from runtime.sampler import SamplingState, derive_seed
from runtime.search.aggregate import aggregate, normalize_step
from runtime.search.answers import Candidate, compile_answer_pattern, extract_answer, select
from runtime.search.strategies import Strategy, make_strategy
from scheduler.sequence import Sequence


@dataclass(eq=False)
class SearchPath:
    controller: "SearchController"
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
    speculating: bool = False  # decoding past `step_end` in an idle slot
    spec_logprobs: list[float] = field(default_factory=list)
    spec_outcome: str | None = None  # set when the speculative tokens complete the next step: how it ends
    spec_finish: str | None = None  # and the path's finish reason if it ends there
    next_score: tuple[str, float] | None = None  # (next unit, its score) from a look-ahead verification
    step_text: StepText | None = None  # the text of the step being decoded (or speculated), incrementally

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

    def on_logits(self, engine, seq, row):
        return [seq]

    def on_sampled(self, engine, seq, out) -> None:
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

    def on_logits(self, engine, seq, row):
        return [seq]

    def on_sampled(self, engine, seq, out) -> None:
        self.path.controller.on_lookahead_token(self, out)


@dataclass(eq=False)
class SearchRoot:
    """The prompt's sequence: prefilled once, then forked into the initial paths."""

    controller: "SearchController"

    @property
    def request_id(self) -> str:
        return self.controller.request_id

    def on_logits(self, engine, seq, row):
        return self.controller.spawn(seq)


class SearchController:
    def __init__(self, engine, request_id: str, params: SamplingParams, search: SearchParams,
                 prompt_ids: list[int], question: str, max_tokens: int, verifier) -> None:
        self.engine = engine
        self.request_id = request_id
        self.params = params
        self.search = search
        self.prompt_ids = prompt_ids
        self.question = question
        self.max_tokens = max_tokens
        self.verifier = verifier
        self.strategy: Strategy = make_strategy(search.strategy, search.n, search.beam_width)
        self.pattern = compile_answer_pattern(search.answer_pattern) if search.answer_pattern else None
        self.root = Sequence(prompt_ids, owner=SearchRoot(self))
        self.generating: set[SearchPath] = set()  # paths whose step is not done (running or queued)
        self.active: set[SearchPath] = set()  # paths of the group running now
        self.queued: deque[list[SearchPath]] = deque()  # the step's later groups
        self.speculating: set[SearchPath] = set()
        self.advance_pending = False
        self.scores_ahead = 0  # step scores taken from a look-ahead verification
        self.spec_tokens = {"used": 0, "discarded": 0}
        self.stepped: list[SearchPath] = []
        self.final: list[SearchPath] = []
        self.step_index = 0
        self.next_uid = 0
        self.pending_scores = 0
        self.to_verify: list[SearchPath] = []
        self.verify_now = False  # whether the step being settled is a verified one (granularity)
        self.lookaheads: set[Lookahead] = set()
        self.committed = ""
        self.is_finished = False
        self.num_cached_tokens = 0
        self.stats = dict(paths_explored=0, tokens_generated=0, verifier_tokens_prefilled=0, verifier_calls=0,
                          prefix_hit_tokens=0, seconds_generating=0.0, seconds_verifying=0.0)
        self._phase_started = time.perf_counter()
        self.deadline = time.monotonic() + search.timeout_s if search.timeout_s is not None else None
        self.timed_out = False

    def _out_of_time(self) -> bool:
        """Past `search.timeout_s`, every running step ends at its next token and the search finishes
        after verifying it, choosing among the paths it has (live ones count as cut short)."""
        if not self.timed_out and self.deadline is not None and time.monotonic() >= self.deadline:
            self.timed_out = True
        return self.timed_out

    # -- paths ----------------------------------------------------------------------------------
    def _new_path(self, seq: Sequence, subtree: int) -> SearchPath:
        uid = self.next_uid
        self.next_uid += 1
        self.stats["paths_explored"] += 1
        sampling = SamplingState(self.params, derive_seed(self.params.seed, uid), self.engine.device,
                                 track_logprobs=True)
        path = SearchPath(self, uid, subtree, seq, sampling, self.search.aggregation, step_start=len(seq.token_ids),
                          step_end=len(seq.token_ids), chunk_start=len(seq.token_ids))
        seq.owner = path
        return path

    def spawn(self, root: Sequence) -> list[Sequence]:
        """The prompt is computed: fork it into the initial paths, which all sample from its logits."""
        self.num_cached_tokens = root.num_cached_tokens
        self.stats["prefix_hit_tokens"] += root.num_cached_tokens
        paths = [self._new_path(self.engine.fork_sequence(root), subtree)
                 for subtree in self.strategy.initial_paths()]
        self.engine.release_sequence(root)
        self._start_step(paths)
        return [p.seq for p in paths]  # every path samples its first token from the prompt's logits

    # -- steps and groups -----------------------------------------------------------------------
    def _step_tokens(self, path: SearchPath) -> int:
        """The most tokens `path` may decode in the step starting now."""
        used = len(path.seq.token_ids)
        room = min(self.max_tokens - (used - len(self.prompt_ids)), self.engine.config.max_model_len - used)
        if self.step_index >= self.search.max_steps - 1:
            return max(1, room)
        return max(1, min(room, self.search.max_step_tokens))

    def _start_step(self, paths: list[SearchPath]) -> None:
        """Run the next step of `paths`: those whose speculative tokens already complete it are
        stepped at once, the rest run in the planned groups."""
        to_run: list[SearchPath] = []
        for path in paths:
            path.step_start = path.step_end
            path.chunk_logprobs.extend(path.spec_logprobs)
            path.spec_logprobs = []
            self.spec_tokens["used"] += path.num_speculative
            if path.spec_outcome is None:
                to_run.append(path)
                continue
            path.step_end = len(path.seq.token_ids)
            path.is_done, path.finish_reason = path.spec_finish is not None, path.spec_finish
            path.spec_outcome = path.spec_finish = None
            path.text = self._text(path)
            if path.is_done:
                self.engine.release_sequence(path.seq)
            self.stepped.append(path)
        if not to_run:
            self._verify()
            return
        self.generating.update(to_run)
        plan = self.engine.plan_step([p.seq for p in to_run], [self._step_tokens(p) for p in to_run])
        self.queued = deque([to_run[i] for i in group] for group in plan)
        self._next_group()

    def _next_group(self) -> None:
        while self.queued:
            group = [p for p in self.queued.popleft() if p in self.generating]
            if group:
                break
        else:
            return
        self.active = set(group)
        for path in group:
            self.engine.resume_sequence(path.seq)
        if self.queued:
            reserve = sum(self.engine.kv.num_blocks_for(len(p.seq.token_ids) + self._step_tokens(p))
                          - len(p.seq.block_table) for p in group)
            self.engine.prepare_group([p.seq for p in self.queued[0]], max(0, reserve))

    def _text(self, path: SearchPath) -> str:
        return self.engine.tokenizer.decode(path.seq.token_ids[len(self.prompt_ids):path.step_end],
                                            skip_special_tokens=True)

    # -- speculative beam extension ---------------------------------------------------------------
    def _may_speculate(self) -> bool:
        return (self.engine.config.speculative_extension and bool(self.active)
                and self.step_index < self.search.max_steps - 1 and self.engine.has_idle_slot())

    def _on_speculative_token(self, path: SearchPath, out) -> None:
        self.stats["tokens_generated"] += 1
        if out.logprob is not None:
            path.spec_logprobs.append(out.logprob)
        reason, ends_step, _ = self._step_outcome(path, out.token_id, path.step_end,
                                                  is_last_step=self.step_index + 1 >= self.search.max_steps - 1)
        if reason is not None or ends_step:
            path.spec_outcome, path.spec_finish = "step", reason
            self._end_speculation(path)
        elif not self.active or not self.engine.has_idle_slot():
            self._end_speculation(path)

    def _end_speculation(self, path: SearchPath) -> None:
        path.speculating = False
        self.speculating.discard(path)
        self.engine.park_sequence(path.seq)

    def stop_speculation(self) -> None:
        """Give every idle slot back (the scheduler has other work, or the group is done)."""
        for path in list(self.speculating):
            self._end_speculation(path)

    def _discard(self, path: SearchPath) -> None:
        """Release a path that ends here; its speculative tokens were for nothing."""
        self.spec_tokens["discarded"] += path.num_speculative
        self.engine.release_sequence(path.seq)

    def _step_outcome(self, owner: SearchPath | Lookahead, token: int, step_start: int, *,
                      is_last_step: bool) -> tuple[str | None, bool, str]:
        """After `token`: (the finish reason if the path ends, whether its step ends, the step's text).

        A path ends on EOS or a stop token, at the length limit, on a boxed answer (DVTS) or on an
        empty step; a step ends at the delimiter or `max_step_tokens`, except on the last step."""
        params = self.params
        seq = owner.seq
        if owner.step_text is None or owner.step_text.start != step_start:
            owner.step_text = StepText(self.engine.tokenizer, step_start)
        text = owner.step_text.text(seq.token_ids)
        num_step_tokens = len(seq.token_ids) - step_start
        if token in params.stop_token_ids or (token in self.engine.eos_ids and not params.ignore_eos):
            return "stop", False, text
        if (len(seq.token_ids) - len(self.prompt_ids) >= self.max_tokens
                or len(seq.token_ids) >= self.engine.config.max_model_len):
            return "length", False, text
        if self.strategy.stops_on_boxed and "\\boxed{" in text and "}" in text.split("\\boxed{")[-1]:
            return "stop", False, text
        ends = not is_last_step and (self.search.step_delimiter in text or num_step_tokens >= self.search.max_step_tokens)
        if ends and not normalize_step(text, self.search.step_delimiter).strip():
            return "stop", False, text  # an empty step ends the path
        return None, ends, text

    def on_token(self, path: SearchPath, out) -> None:
        if path.speculating:
            self._on_speculative_token(path, out)
            return
        seq = path.seq
        self.stats["tokens_generated"] += 1
        if out.logprob is not None:
            path.chunk_logprobs.append(out.logprob)
        reason, ends_step, _ = self._step_outcome(path, out.token_id, path.step_start,
                                                  is_last_step=self.step_index >= self.search.max_steps - 1)
        ends_step = ends_step or (reason is None and self._out_of_time())
        if reason is not None:
            path.is_done, path.finish_reason = True, reason
        if not (ends_step or path.is_done):
            return
        path.step_end = len(seq.token_ids)
        path.text = self._text(path)
        self.generating.discard(path)
        was_active = path in self.active
        self.active.discard(path)
        if path.is_done:
            self.engine.release_sequence(seq)
        elif was_active and self._may_speculate():
            path.speculating = True
            self.speculating.add(path)
        elif was_active:
            self.engine.park_sequence(seq)
        self.stepped.append(path)  # (a queued path sampled its first token and stays parked)
        if not self.active and not self.advance_pending:
            # After the engine has handed out every token of this step: a speculating path's
            # token from the same batch must reach it before the search moves on.
            self.advance_pending = True
            self.engine.defer(self._advance)

    def _advance(self) -> None:
        """The running group is done: run the next one, or verify the step."""
        self.advance_pending = False
        if self.is_finished or self.active:
            return
        self.stop_speculation()
        if self.generating:
            self._next_group()
        else:
            self._verify()

    # -- verification ---------------------------------------------------------------------------
    def _verify(self) -> None:
        now = time.perf_counter()
        self.stats["seconds_generating"] += now - self._phase_started
        self._phase_started = now
        self.step_index += 1
        self.verify_now = (self.step_index % self.search.granularity == 0
                           or self.step_index >= self.search.max_steps)
        to_score = [p for p in self.stepped if self.verify_now or p.is_done]
        known = []
        for path in to_score:
            unit_ids = path.seq.token_ids[path.chunk_start:path.step_end]
            unit = self.engine.tokenizer.decode(unit_ids, skip_special_tokens=True)
            path.chunks.append(normalize_step(unit, self.search.step_delimiter))
            if path.next_score is not None and path.next_score[0] == path.chunks[-1]:
                known.append((path, path.next_score[1]))
            path.next_score = None
        for path, score in known:  # scored ahead, in the previous step's verification
            self.on_score(path, score)
            self.scores_ahead += 1
        scored = {id(path) for path, _ in known}
        to_score = [p for p in to_score if id(p) not in scored]
        self.to_verify = to_score
        if not to_score:
            self._settle()
            return
        rollouts = [p for p in to_score if not p.is_done] if self.search.lookahead else []
        if rollouts and self.step_index < self.search.max_steps:
            self.lookaheads = set()
            for path in rollouts:
                self._start_lookahead(path)
            return
        self._submit_scores()

    def _submit_scores(self) -> None:
        if self.to_verify:
            self.stats["verifier_calls"] += 1
            self.verifier.submit(self, self.to_verify)
        if self.pending_scores == 0 and not self.is_finished:
            self._settle()

    # -- look-ahead -----------------------------------------------------------------------------
    def _start_lookahead(self, path: SearchPath) -> None:
        seq = self.engine.fork_sequence(path.seq, path.step_end)
        greedy = msgspec.structs.replace(self.params, temperature=0.0)
        run = Lookahead(path, seq, SamplingState(greedy, 0, self.engine.device, track_logprobs=True),
                        len(seq.token_ids), self.search.lookahead, len(seq.token_ids))
        seq.owner = run
        self.lookaheads.add(run)
        self.engine.resume_sequence(seq)

    def on_lookahead_token(self, run: Lookahead, out) -> None:
        seq, path = run.seq, run.path
        self.stats["tokens_generated"] += 1
        if out.logprob is not None:
            path.lookahead_logprobs.append(out.logprob)
        reason, ends_step, _ = self._step_outcome(run, out.token_id, run.step_start, is_last_step=False)
        ends = reason is not None
        if ends_step:
            run.steps_left -= 1
            run.step_start = len(seq.token_ids)
            ends = run.steps_left == 0
        if not ends:
            return
        text = self.engine.tokenizer.decode(seq.token_ids[run.start:], skip_special_tokens=True)
        units = [normalize_step(u, self.search.step_delimiter) for u in text.split(self.search.step_delimiter)]
        path.lookahead_units = [u for u in units if u.strip()]
        self.engine.release_sequence(seq)
        self.lookaheads.discard(run)
        if not self.lookaheads:
            self._submit_scores()

    def lookahead_unit(self, path: SearchPath) -> str | None:
        """The path's next unit, if its speculative tokens complete it and it will be scored alone
        (granularity 1, no roll-out look-ahead): a verifier may score it along with this one."""
        if path.spec_outcome is None or self.search.granularity != 1 or self.search.lookahead:
            return None
        unit = self.engine.tokenizer.decode(path.seq.token_ids[path.step_end:], skip_special_tokens=True)
        unit = normalize_step(unit, self.search.step_delimiter)
        return unit if unit.strip() else None

    def on_next_score(self, path: SearchPath, unit: str, score: float) -> None:
        path.next_score = (unit, float(score))

    def on_score(self, path: SearchPath, score: float, prefilled: int = 0, cached: int = 0) -> None:
        path.step_scores.append(float(score))
        path.chunk_logprobs = []
        path.lookahead_units, path.lookahead_logprobs = [], []
        path.chunk_start = path.step_end
        self.stats["verifier_tokens_prefilled"] += prefilled
        self.stats["prefix_hit_tokens"] += cached

    def score_done(self) -> None:
        """Called once a batch of asynchronous scores (judge sequences) has all arrived."""
        self.pending_scores -= 1
        if self.pending_scores == 0:
            self._settle()

    def _settle(self) -> None:
        now = time.perf_counter()
        self.stats["seconds_verifying"] += now - self._phase_started
        self._phase_started = now
        stepped, self.stepped = self.stepped, []
        if self.verify_now:
            final, live = self.strategy.settle(stepped)
        else:
            final, live = [p for p in stepped if p.is_done], [p for p in stepped if not p.is_done]
        for path in final:
            if not path.is_done:  # a candidate cut short when its subtree stopped
                path.finish_reason = "length"
                self._discard(path)
        self.final.extend(final)
        for path in set(stepped) - set(final) - set(live):
            self._discard(path)  # pruned by settling (DVTS keeps only its best)
        if self.step_index >= self.search.max_steps or not live or self._out_of_time():
            for path in live:
                path.finish_reason = "length"
                self._discard(path)
            self.final.extend(live)
            self._finish()
            return
        if self.verify_now:
            live = self._expand(live)
        self._emit_progress(live)
        self._start_step(live)

    def _expand(self, live: list[SearchPath]) -> list[SearchPath]:
        expansion = self.strategy.expand(live)
        by_uid = {p.uid: p for p in live}
        continuing: list[SearchPath] = []
        for uid, count in zip(expansion.parents, expansion.children):
            parent = by_uid.pop(uid)
            for _ in range(count - 1):
                child = self._new_path(self.engine.fork_sequence(parent.seq, parent.step_end), parent.subtree)
                child.chunks, child.step_scores = list(parent.chunks), list(parent.step_scores)
                child.text, child.chunk_start = parent.text, parent.chunk_start
                continuing.append(child)
            continuing.append(parent)
        for pruned in by_uid.values():
            self._discard(pruned)
        return sorted(continuing, key=lambda p: p.uid)

    # -- output ---------------------------------------------------------------------------------
    def _emit_progress(self, live: list[SearchPath]) -> None:
        texts = [p.text for p in live] + [p.text for p in self.final]
        prefix = _common_prefix(texts)
        if len(prefix) > len(self.committed):
            self.engine.emit(Delta(request_id=self.request_id, index=0, text=prefix[len(self.committed):]))
            self.committed = prefix
        if self.search.include_events:
            live = sorted(live, key=lambda p: p.uid)
            self.engine.emit(SearchEvent(request_id=self.request_id, step=self.step_index, live_paths=len(live),
                                         scores=tuple(p.score for p in live)))

    def _finish(self) -> None:
        self.is_finished = True
        candidates = [Candidate(extract_answer(p.text, self.pattern), p.score) for p in self.final]
        order = select(candidates, self.search.select, compare_as_text=self.pattern is not None)
        chosen = [self.final[i] for i in order[:self.params.n]]
        returned = 0
        for index, path in enumerate(chosen):
            output_ids = path.seq.token_ids[len(self.prompt_ids):path.step_end]
            if path.finish_reason == "stop" and output_ids and output_ids[-1] in self.engine.eos_ids:
                output_ids = output_ids[:-1]
            returned += len(output_ids)
            text = path.text[len(self.committed):] if index == 0 else path.text
            self.engine.emit(Delta(
                request_id=self.request_id, index=index, text=text, token_ids=tuple(output_ids),
                finish_reason=path.finish_reason or "stop",
                search=StepScore(score=path.score, step_scores=tuple(path.step_scores),
                                 answer=candidates[self.final.index(path)].answer)))
        if self.search.include_events:
            self.engine.emit(SearchEvent(request_id=self.request_id, step=self.step_index, live_paths=0,
                                         scores=tuple(p.score for p in chosen)))
        self.engine.emit(Finished(
            request_id=self.request_id, prompt_tokens=len(self.prompt_ids), cached_tokens=self.num_cached_tokens,
            completion_tokens=returned,
            search=SearchSummary(strategy=self.search.strategy, steps=self.step_index, tokens_returned=returned,
                                 timed_out=self.timed_out, **self.stats)))
        self.engine.search_finished(self)

    def sequences(self) -> list[Sequence]:
        """Every sequence the search still holds (for aborts)."""
        seqs = [p.seq for p in self.generating] + [p.seq for p in self.stepped if not p.is_done]
        seqs += [run.seq for run in self.lookaheads]
        if self.root.block_table or not self.root.is_finished:
            seqs.append(self.root)
        return seqs


def _common_prefix(texts: list[str]) -> str:
    if not texts:
        return ""
    low, high = min(texts), max(texts)
    i = 0
    while i < len(low) and low[i] == high[i]:
        i += 1
    return low[:i]
