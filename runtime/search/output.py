"""What a search sends back: the committed common prefix as it grows, progress events, its tree's
settled steps, the answers."""

from __future__ import annotations

import math

from runtime.wire.protocol import Delta, Finished, SearchEvent, SearchSummary, StepScore
from runtime.search.anchor import anchor_first
from runtime.search.answers import Candidate, extract_answer, select, structured_answer
from runtime.grammar.thinking import ThinkingStart
from runtime.search.host import SearchHost, Verifier
from runtime.search.paths import SearchPath
from runtime.search.plan import SearchPlan
from runtime.search.strategies import Strategy
from runtime.search.tree import TreeRecorder
from runtime.wire.params import SamplingParams, SearchParams
from runtime.wire.reasoning import split_reasoning


class SearchOutput:
    """What a search sends back, composed into its controller. It owns one piece of state, the text
    committed so far (the paths' common prefix, streamed as it grows); everything else it is handed
    when made (what stays fixed) or in each call (the paths and the step)."""

    def __init__(self, request_id: str, params: SamplingParams, search: SearchParams, prompt_ids: list[int],
                 host: SearchHost, plan: SearchPlan, tree: TreeRecorder, strategy: Strategy, verifier: Verifier,
                 pattern, answer_form: str | None, thinking: ThinkingStart | None) -> None:
        self.request_id = request_id
        self.params = params
        self.search = search
        self.prompt_ids = prompt_ids
        self.host = host
        self.plan = plan
        self.tree = tree
        self.strategy = strategy
        self.verifier = verifier
        self.pattern = pattern
        self.answer_form = answer_form
        self.thinking = thinking
        self.committed = ""

    def progress(self, live: list[SearchPath], final: list[SearchPath], step: int) -> None:
        texts = [p.text for p in live] + [p.text for p in final]
        prefix = _common_prefix(texts)
        if len(prefix) > len(self.committed):
            self.plan.emit(Delta(request_id=self.request_id, index=0, text=prefix[len(self.committed):]))
            self.committed = prefix
        if self.search.include_events:
            live = sorted(live, key=lambda p: p.uid)
            self.plan.emit(SearchEvent(request_id=self.request_id, step=step, live_paths=len(live),
                                       scores=tuple(_reported(p.score) for p in live)))

    def record_steps(self, stepped: list[SearchPath], final: list[SearchPath], verified: bool) -> None:
        """Each stepped path's node gets its step's text, its verifier score if it was verified now
        (`verified`, or it is done), and `finished` if its path is a candidate answer."""
        if not self.tree.enabled:
            return
        for path in stepped:
            text = self.host.tokenizer.decode(path.seq.token_ids[path.step_start:path.step_end],
                                              skip_special_tokens=True)
            scored = (verified or path.is_done) and path.step_scores
            self.tree.change(path.node, "running", text, path.step_scores[-1] if scored else None)
        for path in final:
            self.tree.change(path.node, "finished")

    def answer(self, final: list[SearchPath], anchor: SearchPath | None, step: int, cached_tokens: int,
               timed_out: bool, cut_step_verified: bool | None, stats: dict) -> None:
        """The chosen answers among the `final` candidates, the tree's selection and the summary."""
        form = self.answer_form  # a grammar shaped the output: its answers compare as their canonical texts
        # The strategy's voters and their weights (DeepConf: the confidence filter and its weights).
        voters, weights = self.strategy.candidates(final)
        answers = [self._answer_text(p) for p in voters]
        candidates = [Candidate(structured_answer(text, form) if form else extract_answer(text, self.pattern), weight)
                      for text, weight in zip(answers, weights)]
        rule = self.strategy.selection or self.search.select
        order = select(candidates, rule, compare_as_text=self.pattern is not None or form is not None)
        if anchor in voters and rule == "best":
            order = anchor_first(order, weights, voters.index(anchor), self.verifier)
        chosen = [voters[i] for i in order[:self.params.n]]
        returned = 0
        for index, path in enumerate(chosen):
            output_ids = path.seq.token_ids[len(self.prompt_ids):path.step_end]
            if path.finish_reason == "stop" and output_ids and output_ids[-1] in self.host.eos_ids:
                output_ids = output_ids[:-1]
            returned += len(output_ids)
            text = path.text[len(self.committed):] if index == 0 else path.text
            self.plan.emit(Delta(
                request_id=self.request_id, index=index, text=text, token_ids=tuple(output_ids),
                finish_reason=path.finish_reason or "stop",
                search=StepScore(score=_reported(weights[voters.index(path)]), step_scores=tuple(path.step_scores),
                                 answer=candidates[voters.index(path)].answer)))
        if self.search.include_events:
            self.plan.emit(SearchEvent(request_id=self.request_id, step=step, live_paths=0,
                                       scores=tuple(_reported(weights[voters.index(p)]) for p in chosen)))
        self.tree.select(path.node for path in chosen)
        self.tree.flush(done=True)
        self.plan.emit(Finished(
            request_id=self.request_id, prompt_tokens=len(self.prompt_ids), cached_tokens=cached_tokens,
            completion_tokens=returned,
            search=SearchSummary(strategy=self.search.strategy, steps=step, tokens_returned=returned,
                                 timed_out=timed_out, cut_step_verified=cut_step_verified if timed_out else None,
                                 **self._anchor_summary(anchor, chosen[0]), **stats)))
        self.plan.answered()

    def _answer_text(self, path: SearchPath) -> str:
        """What a path's vote reads: on a thinking model, its answer after the thinking."""
        if self.thinking is None:
            return path.text
        return split_reasoning(path.text, self.thinking.fmt, self.thinking.starts_open)[1]

    def _anchor_summary(self, anchor: SearchPath | None, answer: SearchPath) -> dict:
        """The greedy anchor's part of the summary (runtime.search.anchor); none when no anchor ran."""
        if anchor is None:
            return {}
        return dict(anchor_tokens=anchor.step_end - len(self.prompt_ids),
                    answered_by_anchor=answer is anchor and self.search.select == "best")


def _reported(score: float) -> float | None:
    """A path's score as clients see it: None where no step was verified (ranked as -inf here)."""
    return score if math.isfinite(score) else None


def _common_prefix(texts: list[str]) -> str:
    if not texts:
        return ""
    low, high = min(texts), max(texts)
    i = 0
    while i < len(low) and low[i] == high[i]:
        i += 1
    return low[:i]
