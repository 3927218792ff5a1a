"""The shared step loop of every search strategy, run on the engine's sequences: it reads them through
its port (`runtime.search.host`) and asks for every change in its plan (`runtime.search.plan`).

Paths are engine sequences. Each generates one step (until the step delimiter, `max_step_tokens`,
EOS or the length limit) and is then parked with its blocks. When no path of the request is still
generating, the controller verifies (every `granularity`-th step, and whenever a path finished),
lets the strategy settle and expand, and forks the survivors: children share every block of their
parent, so the search never re-prefills a path.

A step's paths run in the groups the engine plans for the compute pool (`runtime.kv.beam_groups`):
one group decodes its whole step while resident, then the next.

Decoding past a step is asked of objects of its own: speculative beam extension and LookAhead
verification (`runtime.search.speculation`), roll-out look-ahead (`runtime.search.ahead`); what the
search emits is in `runtime.search.output`.
"""

from __future__ import annotations

import time
from collections import deque

from runtime.grammar.matcher import Grammar
from runtime.grammar.thinking import ThinkingStart
from runtime.wire.params import SamplingParams, SearchParams
from runtime.model.sampler import SamplingState
from runtime.search.ahead import Rollouts, lookahead_unit
from runtime.search.anchor import ANCHOR_UID
from runtime.search.aggregate import normalize_step
from runtime.search.answers import compile_answer_pattern
from runtime.search.host import SearchHost, Verifier
from runtime.search.output import SearchOutput
from runtime.search.outlook import StepOutlook
from runtime.search.path_maker import PathMaker
from runtime.search.paths import Lookahead, SearchPath, SearchRoot
from runtime.search.plan import SearchPlan
from runtime.search.speculation import Branch, Speculation
from runtime.search.steps import StepRules
from runtime.search.strategies import Strategy, make_strategy
from runtime.search.tree import TreeRecorder
from scheduler.sequence import Sequence


class SearchController:
    def __init__(self, host: SearchHost, request_id: str, params: SamplingParams, search: SearchParams,
                 prompt_ids: list[int], question: str, max_tokens: int, verifier: Verifier, grammar: Grammar | None = None,
                 answer_form: str | None = None, thinking: ThinkingStart | None = None) -> None:
        """`grammar`: what every path's output must match (its constraint forks with the path);
        `answer_form`: how its answers compare (`runtime.search.answers.structured_answer`), None: as math;
        `thinking`: how a thinking model's paths begin: each path's phases (its budget, its grammar for
        the answer only) fork with it, and its vote reads the answer after the thinking."""
        self.host = host
        self.thinking = thinking
        self.grammar = grammar
        self.request_id = request_id
        self.params = params
        self.search = search
        self.prompt_ids = prompt_ids
        self.question = question
        self.max_tokens = max_tokens
        self.verifier = verifier
        options = dict(warmup=search.deepconf_warmup, eta=search.deepconf_eta, window=search.deepconf_window,
                       keep_top=search.deepconf_keep_top) if search.strategy == "deepconf" else {}
        self.strategy: Strategy = make_strategy(search.strategy, search.n, search.beam_width, params.seed, **options)
        self.outlook = StepOutlook(self.strategy, search, verifier)
        self.rules = StepRules(params, search, host.tokenizer, host.eos_ids, len(prompt_ids), max_tokens,
                               host.config.max_model_len, self.strategy.stops_on_boxed)
        self.pattern = compile_answer_pattern(search.answer_pattern) if search.answer_pattern else None
        self.root = Sequence(prompt_ids, owner=SearchRoot(self))
        self.plan = SearchPlan()  # what it asked of the engine since the engine last took it
        self.paths = PathMaker(self, params, search, len(prompt_ids), host.device, self.strategy.confidence_k,
                               grammar, thinking)
        self.tree = TreeRecorder(request_id, lambda message: self.plan.emit(message), search.include_tree)
        self.generating: set[SearchPath] = set()  # paths whose step is not done (running or queued)
        self.active: set[SearchPath] = set()  # paths of the group running now
        self.to_group: list[SearchPath] = []  # the paths of the latest `GroupStep`, in its order
        self.queued: deque[list[SearchPath]] = deque()  # the step's later groups
        self.speculation = Speculation(self, search.n, search.beam_width, bool(host.config.speculative_extension))
        self.advance_pending = False
        self.scores_ahead = 0  # step scores taken from a look-ahead verification
        self.stepped: list[SearchPath] = []
        self.final: list[SearchPath] = []
        self.step_index = 0
        self.pending_scores = 0
        self.to_verify: list[SearchPath] = []
        self.verify_now = False  # whether the step being settled is a verified one (granularity)
        self.rollouts = Rollouts(self, self._submit_scores)
        self.output = SearchOutput(request_id, params, search, prompt_ids, host, self.plan, self.tree, self.strategy,
                                   verifier, self.pattern, answer_form, thinking)
        self.is_finished = False
        self.num_cached_tokens = 0
        self.stats = dict(paths_explored=0, tokens_generated=0, verifier_tokens_prefilled=0, verifier_calls=0,
                          prefix_hit_tokens=0, seconds_generating=0.0, seconds_verifying=0.0)
        self._phase_started = time.perf_counter()
        self.deadline = time.monotonic() + search.timeout_s if search.timeout_s is not None else None
        self.timed_out = False
        self.cut_step_verified: bool | None = None
        self.scores_before: dict[SearchPath, int] = {}  # per path under verification: its scores before it
        self.anchor: SearchPath | None = None  # the greedy path beside the strategy's (runtime.search.anchor)
        self.waiting: list[int] = []  # subtrees of the initial paths of a later wave (the root is kept for them)

    def take_plan(self) -> SearchPlan:
        """What it asked of the engine since the engine last took it, in the order asked."""
        return self.plan.take()

    @property
    def spec_tokens(self) -> dict[str, int]:
        """Speculative tokens: used by their path, adopted by its children, discarded (read only:
        speculation counts them, `Speculation.count`)."""
        return self.speculation.tokens

    def _out_of_time(self) -> bool:
        """Past `search.timeout_s`, every running step ends at its next token and the search finishes,
        choosing among the paths it has (live ones count as cut short). The step cut short is verified
        only by a free verifier (`confidence`); with a model the answer is chosen by the scores of the
        last step verified in full, so no verifier runs past the deadline (`check_deadline`)."""
        if not self.timed_out and self.deadline is not None and time.monotonic() >= self.deadline:
            self.timed_out = True
        return self.timed_out

    def check_deadline(self) -> None:
        """Called by the engine before every step: a model's verification still running at the
        deadline is abandoned, its scores so far taken back, and the search answers at once."""
        if not self.pending_scores or self.is_finished or not self._out_of_time():
            return
        self.plan.abandon_scoring()
        for path, count in self.scores_before.items():
            del path.step_scores[count:]
        self.pending_scores = 0
        self.cut_step_verified = False
        self._settle()

    # -- paths ----------------------------------------------------------------------------------
    def child_sampling(self, parent: SearchPath | Branch, ordinal: int, at: int | None = None) -> SamplingState:
        return self.paths.child_sampling(parent, ordinal, at)  # (speculation's port)

    def children_limit(self, step: int) -> int:
        """The fewest children a path surviving step `step` will get, as far as is known now: for the
        step being decoded, as many as the strategy gives were every path still decoding to settle live
        beside those live at its end (no more can survive); for a later step, a full step's."""
        if step != self.step_index:
            return self.strategy.widest_child(self.strategy.n)
        live = sum(not p.is_done for p in self.stepped if p is not self.anchor)
        return self.strategy.widest_child(live + sum(p is not self.anchor for p in self.generating))

    likely_children = property(lambda self: self.outlook.likely_children)  # (ChildCounts' port)

    def count_token(self) -> None:
        self.stats["tokens_generated"] += 1

    def spawn(self, root: Sequence) -> list[Sequence]:
        """The prompt is computed: fork it into the initial paths, which all sample from its logits."""
        self.num_cached_tokens = root.num_cached_tokens
        self.stats["prefix_hit_tokens"] += root.num_cached_tokens
        subtrees = self.strategy.initial_paths()
        first, self.waiting = subtrees[:self.strategy.num_first_wave()], subtrees[self.strategy.num_first_wave():]
        paths = [self.paths.first(self.plan.fork(root), subtree) for subtree in first]
        if self.search.greedy_anchor and not self.params.is_greedy:
            self.anchor = self.paths.first(self.plan.fork(root), ANCHOR_UID, anchor=True)
            paths.append(self.anchor)
        self.stats["paths_explored"] += len(paths)
        if self.waiting:
            self.plan.park(root)  # a later wave's paths share its blocks
        else:
            self.plan.release(root)
        self.tree.change(self.tree.add(None, 0), "kept", text=self.question)  # the root, every path's node
        self._start_step(paths)
        self.tree.flush()
        return [p.seq for p in paths]  # every path samples its first token from the prompt's logits

    def _next_wave(self) -> list[SearchPath]:
        """The waiting initial paths, forked from the kept prompt: each computes the prompt's last token
        again for its first token's logits (`KVManager.fork`), and shares every block before it."""
        paths = [self.paths.first(self.plan.fork(self.root, len(self.prompt_ids)), subtree) for subtree in self.waiting]
        self.stats["paths_explored"] += len(paths)
        self._drop_waiting()
        return paths

    def _drop_waiting(self) -> None:
        if self.waiting:
            self.waiting = []
            self.plan.release(self.root)

    def _is_last_step(self) -> bool:
        """Whether the step being decoded runs to the paths' end (no step delimiter)."""
        return self.strategy.whole_traces or self.step_index >= self.search.max_steps - 1

    # -- steps and groups -----------------------------------------------------------------------
    def _step_tokens(self, path: SearchPath) -> int:
        """The most tokens `path` may decode in the step starting now."""
        used = len(path.seq.token_ids)
        room = min(self.max_tokens - (used - len(self.prompt_ids)), self.host.config.max_model_len - used)
        if self._is_last_step():
            return max(1, room)
        return max(1, min(room, self.search.max_step_tokens))

    def _start_step(self, paths: list[SearchPath]) -> None:
        """Run the next step of `paths`: those whose speculative tokens already complete it are
        stepped at once, the rest run in the planned groups."""
        to_run: list[SearchPath] = []
        for path in paths:
            path.node = self.tree.add(path.node, self.step_index + 1)
            path.step_start = path.step_end
            ahead = self.speculation.take_step(path)  # this step, decoded ahead (in part, or whole)
            if ahead is None:
                to_run.append(path)
                continue
            path.chunk_logprobs.extend(ahead.logprobs)
            if ahead.end is None:
                to_run.append(path)  # it decodes the rest of its step
                continue
            path.step_end = ahead.end
            path.is_done, path.finish_reason = ahead.finish is not None, ahead.finish
            path.text = self._text(path)
            if path.is_done:
                self.plan.release(path.seq)
            self.stepped.append(path)
        if not to_run:
            self._verify()
            return
        self.generating.update(to_run)
        self.to_group = to_run
        self.plan.group_step([p.seq for p in to_run], [self._step_tokens(p) for p in to_run])

    def start_groups(self, groups: list[list[int]]) -> None:
        """The engine's answer to `GroupStep`: the step's paths in the groups to run, in order."""
        self.queued = deque([self.to_group[i] for i in group] for group in groups)
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
            self.plan.resume(path.seq)
        if not self._out_of_time() and not self._is_last_step():
            # Paths whose step is done already (decoded ahead) decode their children's steps meanwhile.
            self.speculation.open(self.to_group + self.stepped, [p for p in self.stepped if not p.is_done])
        if self.queued:
            reserve = sum(self.host.kv.num_blocks_for(len(p.seq.token_ids) + self._step_tokens(p))
                          - len(p.seq.block_table) for p in group)
            self.plan.prefetch([p.seq for p in self.queued[0]], max(0, reserve))

    def _text(self, path: SearchPath) -> str:
        return self.host.tokenizer.decode(path.seq.token_ids[len(self.prompt_ids):path.step_end],
                                            skip_special_tokens=True)

    def _discard(self, path: SearchPath) -> None:
        """Release a path that ends here; its speculative tokens, and its branches', were for nothing."""
        self.speculation.count("discarded", path.num_speculative)
        self.speculation.release(path)
        self.plan.release(path.seq)

    def on_token(self, path: SearchPath, out) -> None:
        if self.speculation.is_running(path):
            self.speculation.on_token(path, out)
            return
        seq = path.seq
        self.stats["tokens_generated"] += 1
        if out.logprob is not None:
            path.chunk_logprobs.append(out.logprob)
        reason, ends_step = self.rules.outcome(path, out.token_id, path.step_start, is_last_step=self._is_last_step())
        if out.confidence is not None and self.strategy.observe(path.uid, out.confidence) and path is not self.anchor:
            reason = reason or "length"  # stopped by its confidence: released now, pruned when it settles
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
            self.plan.release(seq)
        elif was_active and self.speculation.on_step_done(path):
            pass  # its slot is speculation's: it decodes on past its step, or a branch takes the slot
        elif was_active:
            self.plan.park(seq)
        self.stepped.append(path)  # (a queued path sampled its first token and stays parked)
        self.speculation.path_ended()  # what is known of the settling changed (pruned for sure, fewer live)
        if was_active and not self.active:
            self.speculation.group_done(path)
        if not self.active and not self.advance_pending:
            # After the engine has handed out every token of this step: a speculating path's
            # token from the same batch must reach it before the search moves on.
            self.advance_pending = self.plan.advance = True

    def advance(self) -> None:
        """The running group is done (`SearchPlan.advance`): run the next one, or verify the step."""
        self.advance_pending = False
        if self.is_finished or self.active:
            return
        self.speculation.stop()
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
        to_score = [p for p in self.stepped if self.verify_now or p.is_done] if self.strategy.uses_verifier else []
        if self._out_of_time():
            self.cut_step_verified = bool(to_score) and self.verifier.is_free
            if to_score and not self.cut_step_verified:
                self._settle()
                return
        known = []
        for path in to_score:
            unit_ids = path.seq.token_ids[path.chunk_start:path.step_end]
            unit = self.host.tokenizer.decode(unit_ids, skip_special_tokens=True)
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
            self.rollouts.start(rollouts)
            return
        self._submit_scores()

    def _submit_scores(self) -> None:
        """A free verifier scores at once; a model's scores (`Verify`) arrive in later steps (`on_score`)."""
        if self.to_verify:
            self.stats["verifier_calls"] += 1
            self.scores_before = {path: len(path.step_scores) for path in self.to_verify}
            if not self.verifier.is_free:
                self.plan.verify(self.to_verify)
                return
            self.verifier.submit(self, self.to_verify)
        if self.pending_scores == 0 and not self.is_finished:
            self._settle()

    def on_score(self, path: SearchPath, score: float, prefilled: int = 0, cached: int = 0) -> None:
        path.step_scores.append(float(score))
        path.chunk_logprobs = []
        path.lookahead_units, path.lookahead_logprobs = [], []
        path.chunk_start = path.step_end
        self.stats["verifier_tokens_prefilled"] += prefilled
        self.stats["prefix_hit_tokens"] += cached

    def expect_scores(self) -> None:
        """A batch of asynchronous scores (a model's) is on its way: the search settles once all arrived."""
        self.pending_scores += 1

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
        if self.verify_now:  # the anchor is no strategy's: it lives until it is done
            final, live = self.strategy.settle([p for p in stepped if p is not self.anchor])
            if self.anchor in stepped:
                (final if self.anchor.is_done else live).append(self.anchor)
        else:
            final, live = [p for p in stepped if p.is_done], [p for p in stepped if not p.is_done]
        for path in final:
            if not path.is_done:  # a candidate cut short when its subtree stopped
                path.finish_reason = "length"
                self._discard(path)
        self.final.extend(final)
        self.output.record_steps(stepped, final, self.verify_now)
        for path in set(stepped) - set(final) - set(live):
            self._discard(path)  # pruned by settling (DVTS keeps only its best)
            self.tree.change(path.node, "pruned")
        if self._out_of_time() and self.cut_step_verified is None:
            self.cut_step_verified = True  # the deadline passed while this step's scores came in
        if not live and self.waiting and not self._out_of_time():
            self.output.progress(live, self.final, self.step_index)
            self._start_step(self._next_wave())  # the next wave of whole traces
            self.tree.flush()
            return
        if self.step_index >= self.search.max_steps or not live or self._out_of_time():
            self._drop_waiting()
            for path in live:
                path.finish_reason = "length"
                self._discard(path)
                self.tree.change(path.node, "finished")
            self.final.extend(live)
            self._finish()
            return
        if self.verify_now:
            live = self._expand(live)
        for path in live:
            self.tree.change(path.node, "kept")
        self.output.progress(live, self.final, self.step_index)
        self._start_step(live)
        self.tree.flush()

    def _expand(self, live: list[SearchPath]) -> list[SearchPath]:
        by_uid = {p.uid: p for p in live if p is not self.anchor}
        expansion = self.strategy.expand(list(by_uid.values()))
        continuing = [self.anchor] if self.anchor in live else []
        for uid, count in zip(expansion.parents, expansion.children):
            parent = by_uid.pop(uid)
            for ordinal in range(1, count):  # a branch that decoded the child is adopted
                branch = self.speculation.adopt(parent, ordinal)
                if branch is None:
                    child = self.paths.child(self.plan.fork(parent.seq, parent.step_end), parent, ordinal)
                else:
                    child = self.paths.child(branch.seq, parent, ordinal, branch.sampling, branch.step_text)
                    self.speculation.hand_over(branch, child)
                self.stats["paths_explored"] += 1
                continuing.append(child)
            self.speculation.release_unadopted(parent)  # branches for children it does not get
            continuing.append(parent)
        for pruned in by_uid.values():
            self._discard(pruned)
            self.tree.change(pruned.node, "pruned")
        return sorted(continuing, key=lambda p: p.uid)

    # -- what the verifiers and roll-outs tell it ---------------------------------------------------
    def on_lookahead_token(self, run: Lookahead, out) -> None:
        self.rollouts.on_token(run, out)

    def lookahead_unit(self, path: SearchPath) -> str | None:
        return lookahead_unit(path, self.speculation.steps_ahead(path), self.search, self.host.tokenizer)

    def on_next_score(self, path: SearchPath, unit: str, score: float) -> None:
        path.next_score = (unit, float(score))

    def _finish(self) -> None:
        self.is_finished = True
        self.output.answer(self.final, self.anchor, self.step_index, self.num_cached_tokens, self.timed_out,
                           self.cut_step_verified, self.stats)

    def cancel(self) -> None:
        """Aborted: a score still on its way is not taken, and nothing more is asked."""
        self.is_finished = True

    def sequences(self) -> list[Sequence]:
        """Every sequence the search still holds (for aborts)."""
        seqs = [p.seq for p in self.generating] + [p.seq for p in self.stepped if not p.is_done]
        seqs += self.rollouts.sequences() + self.speculation.sequences()
        if self.root.block_table or not self.root.is_finished:
            seqs.append(self.root)
        return seqs
