"""What a search sends back: the committed common prefix as it grows, progress events, its tree's
settled steps, the answers."""

from __future__ import annotations

import math

from runtime.wire.protocol import Delta, Finished, SearchEvent, SearchSummary, StepScore
from runtime.search.anchor import anchor_first
from runtime.search.answers import Candidate, extract_answer, select, structured_answer
from runtime.search.paths import SearchPath
from runtime.wire.reasoning import split_reasoning


class SearchOutput:
    """The part of `SearchController` that emits messages; it shares the controller's state."""

    def _emit_progress(self, live: list[SearchPath]) -> None:
        texts = [p.text for p in live] + [p.text for p in self.final]
        prefix = _common_prefix(texts)
        if len(prefix) > len(self.committed):
            self.plan.emit(Delta(request_id=self.request_id, index=0, text=prefix[len(self.committed):]))
            self.committed = prefix
        if self.search.include_events:
            live = sorted(live, key=lambda p: p.uid)
            self.plan.emit(SearchEvent(request_id=self.request_id, step=self.step_index, live_paths=len(live),
                                         scores=tuple(_reported(p.score) for p in live)))

    def _record_steps(self, stepped: list[SearchPath], final: list[SearchPath]) -> None:
        """Each stepped path's node gets its step's text, its verifier score if it was verified now,
        and `finished` if its path is a candidate answer."""
        if not self.tree.enabled:
            return
        for path in stepped:
            text = self.host.tokenizer.decode(path.seq.token_ids[path.step_start:path.step_end],
                                                skip_special_tokens=True)
            scored = (self.verify_now or path.is_done) and path.step_scores
            self.tree.change(path.node, "running", text, path.step_scores[-1] if scored else None)
        for path in final:
            self.tree.change(path.node, "finished")

    def _finish(self) -> None:
        self.is_finished = True
        form = self.answer_form  # a grammar shaped the output: its answers compare as their canonical texts
        # The strategy's voters and their weights (DeepConf: the confidence filter and its weights).
        voters, weights = self.strategy.candidates(self.final)
        answers = [self._answer_text(p) for p in voters]
        candidates = [Candidate(structured_answer(text, form) if form else extract_answer(text, self.pattern), weight)
                      for text, weight in zip(answers, weights)]
        rule = self.strategy.selection or self.search.select
        order = select(candidates, rule, compare_as_text=self.pattern is not None or form is not None)
        if self.anchor in voters and rule == "best":
            order = anchor_first(order, weights, voters.index(self.anchor), self.verifier)
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
            self.plan.emit(SearchEvent(request_id=self.request_id, step=self.step_index, live_paths=0,
                                         scores=tuple(_reported(weights[voters.index(p)]) for p in chosen)))
        self.tree.select(path.node for path in chosen)
        self.tree.flush(done=True)
        self.plan.emit(Finished(
            request_id=self.request_id, prompt_tokens=len(self.prompt_ids), cached_tokens=self.num_cached_tokens,
            completion_tokens=returned,
            search=SearchSummary(strategy=self.search.strategy, steps=self.step_index, tokens_returned=returned,
                                 timed_out=self.timed_out,
                                 cut_step_verified=self.cut_step_verified if self.timed_out else None,
                                 **self._anchor_summary(chosen[0]), **self.stats)))
        self.plan.answered()

    def _answer_text(self, path: SearchPath) -> str:
        """What a path's vote reads: on a thinking model, its answer after the thinking."""
        if self.thinking is None:
            return path.text
        return split_reasoning(path.text, self.thinking.fmt, self.thinking.starts_open)[1]

    def _anchor_summary(self, answer: SearchPath) -> dict:
        """The greedy anchor's part of the summary (runtime.search.anchor); none when no anchor ran."""
        if self.anchor is None:
            return {}
        return dict(anchor_tokens=self.anchor.step_end - len(self.prompt_ids),
                    answered_by_anchor=answer is self.anchor and self.search.select == "best")


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
