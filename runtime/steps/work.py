"""The step's work beside plain requests, behind one owner: the searches under way, the given
responses being scored (`POST /v1/rewards`), the judge's questions, the reward models' stores, and
speculation's slots.

The engine calls it around the forward pass: `check_deadlines` and `before_forward` (scores read
by the stores go to their searches, speculation gives its slots back to waiting work or takes idle
ones again), then `on_logits` / `on_sampled` per row and `after_step`. Whatever reaches a search
adds to its plan; right after each such call the plan is carried out (`_carry_out`, one call site),
action by action, through the engine's port (`runtime.steps.host`). A `GroupStep` is answered with
the groups the engine planned, and what the search asks in return goes first in the queue: no
recursion, the same order as asked.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from runtime.grammar.matcher import Grammar
from runtime.grammar.thinking import ThinkingStart
from runtime.requests.state import InvalidRequest, question_of
from runtime.search.aggregate import aggregate, normalize_step, split_steps
from runtime.search.controller import SearchController
from runtime.search.plan import AbandonScoring, Answered, Emit, Fork, GroupStep, Park, Prefetch, Release, Resume, Verify
from runtime.steps.host import StepsHost
from runtime.verify.rewards import RewardScoring
from runtime.wire.protocol import FromRuntime, GenerateRequest, Reward, Rewarded, RewardRequest
from scheduler.sequence import Sequence


class StepWork:
    """`build_scorers(judge_host)`: every verifier a search may name and the reward models' stores
    (`runtime.verify.verifier_store.build_scorers`); the judge asks for its questions through this
    work, which holds them per request."""

    def __init__(self, host: StepsHost, build_scorers: Callable, max_model_len: int) -> None:
        self.host = host
        self.max_model_len = max_model_len
        self.searches: dict[str, SearchController] = {}
        self.rewards: dict[str, RewardScoring] = {}  # given responses being scored
        self.scoring: dict[str, list[Sequence]] = {}  # request id -> its judge questions
        self.verifier_seconds: list[float] = []  # how long each verification took, since last taken
        self.ended: list[SearchController] = []  # searches whose running group this step's tokens ended
        self.scorers, self.verifier_stores = build_scorers(self)

    @property
    def has_work(self) -> bool:
        return any(store.has_work for store in self.verifier_stores)

    def live_paths(self) -> int:
        return sum(len(c.generating) + len(c.stepped) for c in self.searches.values())

    # -- requests -------------------------------------------------------------------------------
    def add_search(self, request: GenerateRequest, ids: list[int], max_tokens: int, grammar: Grammar | None,
                   answer_form: str | None, thinking: ThinkingStart | None) -> SearchController:
        search = request.search
        try:
            controller = SearchController(self.host, request.request_id, request.sampling, search, ids,
                                          question_of(request), max_tokens, self.scorers[search.verifier], grammar,
                                          answer_form, thinking)
        except ValueError as exc:  # a bad answer_pattern or strategy
            raise InvalidRequest(str(exc), "search") from None
        self.searches[request.request_id] = controller
        self.host.add_sequence(controller.root)
        return controller

    def add_rewards(self, request: RewardRequest) -> list[FromRuntime]:
        """Score given responses step by step with a search's verifier (runtime.verify.rewards): the
        Rewarded comes from the step that reads the last score."""
        try:
            scorer = self.scorers.get(request.verifier)
            if scorer is None or not RewardScoring.can_score(scorer):
                known = ", ".join(name for name, s in self.scorers.items() if RewardScoring.can_score(s))
                raise InvalidRequest(f"the verifier {request.verifier!r} cannot score given text; this server's "
                                     f"verifiers that can: {known}", "verifier")
            candidates = [given_steps(c.steps, c.text, request.step_delimiter, request.max_steps, c.param)
                          for c in request.candidates]
            scoring = RewardScoring(request.request_id, question_of(request), candidates,
                                    lambda done: self.host.emit(self._rewarded(done, request.aggregation)))
            limit = min(self.max_model_len, scorer.max_input_tokens or self.max_model_len)
            for candidate, tokens in zip(request.candidates, scoring.input_lengths(scorer)):
                if tokens > limit:
                    raise InvalidRequest(f"the {request.verifier} verifier's input for this response is {tokens} "
                                         f"tokens, over its limit of {limit}", candidate.param,
                                         code="context_length_exceeded")
        except InvalidRequest as err:
            return [err.to_message(request.request_id)]
        self.rewards[request.request_id] = scoring
        scoring.start(scorer)
        return []

    def _rewarded(self, scoring: RewardScoring, aggregation: str) -> Rewarded:
        self.rewards.pop(scoring.request_id, None)
        for seq in self.scoring.pop(scoring.request_id, []):
            self.host.release_sequence(seq)  # the judge's questions
        rewards = tuple(Reward(steps=tuple(steps), step_scores=tuple(scores), score=aggregate(scores, aggregation))
                        for steps, scores in zip(scoring.candidates, scoring.step_scores))
        return Rewarded(request_id=scoring.request_id, rewards=rewards, input_tokens=scoring.input_tokens,
                        cached_tokens=scoring.cached_tokens)

    def abort(self, request_id: str) -> None:
        client = self.searches.pop(request_id, None) or self.rewards.pop(request_id, None)
        if client is None:
            return
        client.cancel()
        for store in self.verifier_stores:
            store.abort(client)
        for seq in client.sequences() + self.scoring.pop(request_id, []):
            self.host.release_sequence(seq)

    def forget(self, controller: SearchController) -> None:
        """A search answered: it and the questions it kept for a next verification go."""
        self.searches.pop(controller.request_id, None)
        for seq in self.scoring.pop(controller.request_id, []):
            self.host.release_sequence(seq)

    # -- the step -------------------------------------------------------------------------------
    def check_deadlines(self) -> None:
        """Before every step: a search past its deadline answers now, verified or not."""
        for controller in list(self.searches.values()):
            controller.check_deadline()
            self._carry_out(controller)

    def before_forward(self, token_cap: int | None) -> None:
        """The reward models' stores run their step (each score to its search, in the order read);
        speculation gives its slots back while other work waits, and takes idle ones again."""
        for store in (store for store in self.verifier_stores if store.has_work):
            for score in store.step(token_cap):
                score.deliver()
                self._carry_out(self.searches.get(score.request_id))
        waiting = self.host.has_waiting()
        for controller in list(self.searches.values()):
            if waiting:
                controller.speculation.pause()
                self._carry_out(controller)
            elif controller.speculation.refill():
                self._carry_out(controller)

    def on_logits(self, seq: Sequence, row) -> list[Sequence]:
        """A row's logits to its sequence's owner: the sequences that sample from them (a search's
        prompt: its first paths; a judge's question: none)."""
        targets = seq.owner.on_logits(seq, row)
        self._carry_out(self.searches.get(seq.owner.request_id))
        return targets

    def on_sampled(self, seq: Sequence, out) -> None:
        seq.owner.on_sampled(seq, out)
        search = self.searches.get(seq.owner.request_id)
        if self._carry_out(search):
            self.ended.append(search)

    def after_step(self) -> None:
        """Only now: a speculating path's token of this step must reach it before its search moves on."""
        ended, self.ended = self.ended, []
        for search in ended:
            search.advance()
            self._carry_out(search)

    def _carry_out(self, controller: SearchController | None) -> bool:
        """Do what a search asked for since it was last reached, in order; whether it waits for the step's end."""
        if controller is None:
            return False
        plan = controller.take_plan()
        actions, advance, host = deque(plan.actions), plan.advance, self.host
        while actions:
            match actions.popleft():
                case Fork(parent, child, num_tokens):
                    host.fork_sequence(parent, child, num_tokens)
                case Release(seq):
                    host.release_sequence(seq)
                case Park(seq):
                    host.park_sequence(seq)
                case Resume(seq):
                    host.resume_sequence(seq)
                case GroupStep(seqs, step_tokens):  # answered: what it asks in return comes first
                    controller.start_groups(host.plan_step(seqs, step_tokens))
                    answer = controller.take_plan()
                    actions.extendleft(reversed(answer.actions))
                    advance = advance or answer.advance
                case Prefetch(seqs, reserve):
                    host.prefetch(seqs, reserve)
                case Verify(paths):
                    controller.verifier.submit(controller, paths)
                case Emit(message):
                    host.emit(message)
                case AbandonScoring():  # queued reward-model jobs, the judge's questions (computing or kept)
                    for store in self.verifier_stores:
                        store.abort(controller)
                    for seq in self.scoring.pop(controller.request_id, []):
                        host.release_sequence(seq)
                case Answered():
                    host.search_finished(controller)
        return advance

    # -- the judge's questions (runtime.verify.host.JudgeHost): through to the engine, each new one
    # kept under its request (its owner names it) until that request ends ---------------------
    def add_sequence(self, seq: Sequence) -> None:
        self.scoring.setdefault(seq.owner.request_id, []).append(seq)
        self.host.add_sequence(seq)

    def fork_prompt(self, parent: Sequence, child: Sequence, num_shared: int) -> None:
        self.scoring.setdefault(child.owner.request_id, []).append(child)
        self.host.fork_prompt(parent, child, num_shared)

    def fork_sequence(self, parent: Sequence, child: Sequence, num_tokens: int | None) -> None:
        self.scoring.setdefault(child.owner.request_id, []).append(child)
        self.host.fork_sequence(parent, child, num_tokens)

    def resume_sequence(self, seq: Sequence) -> None:
        self.host.resume_sequence(seq)

    def park_sequence(self, seq: Sequence) -> None:
        self.host.park_sequence(seq)

    def release_sequence(self, seq: Sequence) -> None:
        self.host.release_sequence(seq)

    def observe_verifier(self, seconds: float) -> None:
        self.verifier_seconds.append(seconds)

    def take_verifier_seconds(self) -> tuple[float, ...]:
        """The verifications' seconds since the last take (each handed out once)."""
        taken, self.verifier_seconds = tuple(self.verifier_seconds), []
        return taken

    def fail_request(self, request_id: str, message: str, status: int = 503, code: str = "kv_cache_exhausted") -> None:
        self.host.fail_request(request_id, message, status, code)


def given_steps(steps: tuple[str, ...] | None, text: str | None, delimiter: str, max_steps: int,
                param: str) -> list[str]:
    """A given response's steps as a search's verifier sees its own: each without its trailing
    delimiter; a text is cut at the delimiter as a finished answer is (runtime.search.aggregate)."""
    found = [normalize_step(step, delimiter) for step in steps] if steps is not None \
        else split_steps(text or "", delimiter)
    if not found:
        raise InvalidRequest("the response has no steps" + ("" if steps is not None else
                             f" once cut at the step delimiter {delimiter!r}"), param)
    if steps is not None and any(not step.strip() for step in found):
        raise InvalidRequest("every step must hold some text", param)
    if len(found) > max_steps:
        raise InvalidRequest(f"the response has {len(found)} steps, over this server's cap of {max_steps}", param)
    return found
