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
verification (`runtime.search.speculation`), roll-out look-ahead (`runtime.search.ahead`); a step's
verification is `runtime.search.verification`'s, the time budget `runtime.search.deadline`'s, how
paths are made (their samplers, grammar and thinking phases) `runtime.search.path_maker`'s; what the
search emits is in `runtime.search.output`.
"""

from __future__ import annotations

from collections import deque

from runtime.grammar.matcher import Grammar
from runtime.grammar.thinking import ThinkingStart
from runtime.wire.params import SamplingParams, SearchParams
from runtime.model.sampler import SamplingState
from runtime.search.ahead import lookahead_unit
from runtime.search.anchor import ANCHOR_UID
from runtime.search.answers import compile_answer_pattern
from runtime.search.deadline import Deadline
from runtime.search.host import SearchHost, Verifier
from runtime.search.output import SearchOutput
from runtime.search.outlook import StepOutlook
from runtime.search.path_maker import PathMaker
from runtime.search.paths import Branch, Lookahead, SearchPath, SearchRoot
from runtime.search.plan import SearchPlan
from runtime.search.speculation import Speculation
from runtime.search.steps import StepRules
from runtime.search.strategies import Strategy, make_strategy
from runtime.search.tree import TreeRecorder
from runtime.search.verification import Verification
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
        self.stepped: list[SearchPath] = []
        self.final: list[SearchPath] = []
        self.step_index = 0
        self.deadline = Deadline(search.timeout_s)
        self.verification = Verification(self, self._settle)
        self.output = SearchOutput(request_id, params, search, prompt_ids, host, self.plan, self.tree, self.strategy,
                                   verifier, self.pattern, answer_form, thinking)
        self.is_finished = False
        self.num_cached_tokens = 0
        self.counts = dict(paths_explored=0, tokens_generated=0, prefix_hit_tokens=0)
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

    @property
    def stats(self) -> dict:
        """Its counts and its verification's (read only: a new dict)."""
        verified = self.verification.stats
        prefix_hits = self.counts["prefix_hit_tokens"] + verified["prefix_hit_tokens"]
        return {**self.counts, **verified, "prefix_hit_tokens": prefix_hits}

    def check_deadline(self) -> None:
        """Called by the engine before every step: a model's verification still running at the
        deadline is abandoned, its scores so far taken back, and the search answers at once."""
        if self.verification.is_pending and not self.is_finished and self.deadline.passed():
            self.verification.abandon()
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
        self.counts["tokens_generated"] += 1

    def spawn(self, root: Sequence) -> list[Sequence]:
        """The prompt is computed: fork it into the initial paths, which all sample from its logits."""
        self.num_cached_tokens = root.num_cached_tokens
        self.counts["prefix_hit_tokens"] += root.num_cached_tokens
        subtrees = self.strategy.initial_paths()
        first, self.waiting = subtrees[:self.strategy.num_first_wave()], subtrees[self.strategy.num_first_wave():]
        paths = [self.paths.first(self.plan.fork(root), subtree) for subtree in first]
        if self.search.greedy_anchor and not self.params.is_greedy:
            self.anchor = self.paths.first(self.plan.fork(root), ANCHOR_UID, anchor=True)
            paths.append(self.anchor)
        self.counts["paths_explored"] += len(paths)
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
        self.counts["paths_explored"] += len(paths)
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
        if not self.deadline.passed() and not self._is_last_step():
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
        self.counts["tokens_generated"] += 1
        if out.logprob is not None:
            path.chunk_logprobs.append(out.logprob)
        reason, ends_step = self.rules.outcome(path, out.token_id, path.step_start, is_last_step=self._is_last_step())
        if out.confidence is not None and self.strategy.observe(path.uid, out.confidence) and path is not self.anchor:
            reason = reason or "length"  # stopped by its confidence: released now, pruned when it settles
        ends_step = ends_step or (reason is None and self.deadline.passed())
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
        self.step_index += 1
        self.verification.start(self.stepped, self.step_index, self.strategy.uses_verifier)

    def on_score(self, path: SearchPath, score: float, prefilled: int = 0, cached: int = 0) -> None:
        self.verification.on_score(path, score, prefilled, cached)

    def expect_scores(self) -> None:
        """A batch of asynchronous scores (a model's) is on its way: the search settles once all arrived."""
        self.verification.expect_scores()

    def score_done(self) -> None:
        """Called once a batch of asynchronous scores (judge sequences) has all arrived."""
        self.verification.score_done()

    def _settle(self) -> None:
        self.verification.settled()
        verify_now = self.verification.verify_now
        stepped, self.stepped = self.stepped, []
        if verify_now:  # the anchor is no strategy's: it lives until it is done
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
        self.output.record_steps(stepped, final, verify_now)
        for path in set(stepped) - set(final) - set(live):
            self._discard(path)  # pruned by settling (DVTS keeps only its best)
            self.tree.change(path.node, "pruned")
        self.deadline.step_settled()
        if not live and self.waiting and not self.deadline.passed():
            self.output.progress(live, self.final, self.step_index)
            self._start_step(self._next_wave())  # the next wave of whole traces
            self.tree.flush()
            return
        if self.step_index >= self.search.max_steps or not live or self.deadline.passed():
            self._drop_waiting()
            for path in live:
                path.finish_reason = "length"
                self._discard(path)
                self.tree.change(path.node, "finished")
            self.final.extend(live)
            self._finish()
            return
        if verify_now:
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
                self.counts["paths_explored"] += 1
                continuing.append(child)
            self.speculation.release_unadopted(parent)  # branches for children it does not get
            continuing.append(parent)
        for pruned in by_uid.values():
            self._discard(pruned)
            self.tree.change(pruned.node, "pruned")
        return sorted(continuing, key=lambda p: p.uid)

    # -- what the verifiers and roll-outs tell it ---------------------------------------------------
    def on_lookahead_token(self, run: Lookahead, out) -> None:
        self.verification.on_lookahead_token(run, out)

    def lookahead_unit(self, path: SearchPath) -> str | None:
        return lookahead_unit(path, self.speculation.steps_ahead(path), self.search, self.host.tokenizer)

    def on_next_score(self, path: SearchPath, unit: str, score: float) -> None:
        path.next_score = (unit, float(score))

    def _finish(self) -> None:
        self.is_finished = True
        self.output.answer(self.final, self.anchor, self.step_index, self.num_cached_tokens, self.deadline.timed_out,
                           self.deadline.cut_step_verified, self.stats)

    def cancel(self) -> None:
        """Aborted: a score still on its way is not taken, and nothing more is asked."""
        self.is_finished = True

    def sequences(self) -> list[Sequence]:
        """Every sequence the search still holds (for aborts)."""
        seqs = [p.seq for p in self.generating] + [p.seq for p in self.stepped if not p.is_done]
        seqs += self.verification.sequences() + self.speculation.sequences()
        if self.root.block_table or not self.root.is_finished:
            seqs.append(self.root)
        return seqs
