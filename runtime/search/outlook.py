"""What a search's strategy and verifier say of the steps to come, asked by speculation before the
steps settle: each step's shape, a free verifier's score read ahead, the children a survivor likely
gets, the settling replayed over steps decoded ahead, the paths surely pruned. Fixed when the search
is made; the search's own state comes in each question."""

from __future__ import annotations

from types import SimpleNamespace

from runtime.search.aggregate import aggregate
from runtime.search.host import Verifier
from runtime.search.paths import SearchPath
from runtime.search.strategies import Expansion, Strategy
from runtime.wire.params import SearchParams


class StepOutlook:
    def __init__(self, strategy: Strategy, search: SearchParams, verifier: Verifier) -> None:
        self.strategy = strategy
        self.search = search
        self.verifier = verifier

    def step_shape(self, step: int) -> tuple[bool, bool] | None:
        """Step `step`'s shape: whether it runs to the paths' end (no step delimiter), and whether the
        settling after it expands the survivors; None where the search has no such step."""
        if self.strategy.whole_traces or step >= self.search.max_steps:
            return None
        verifies = (step + 1) % self.search.granularity == 0 or step + 1 >= self.search.max_steps
        return step >= self.search.max_steps - 1, verifies and self.strategy.expands

    def score_ahead(self, logprobs: list[float]) -> float | None:
        """The score the verifier will give a step of these sampled tokens' log-probabilities, where it
        reads nothing else (`confidence`: free, and each step is a unit of its own with no roll-outs);
        None where only verifying tells."""
        if not self.strategy.uses_verifier or self.search.granularity != 1 or self.search.lookahead:
            return None
        return self.verifier.score_of(logprobs)

    def expansion_ahead(self, candidates) -> Expansion | None:
        """The strategy's expansion of lineages that completed a step ahead, with their scores to it
        (`runtime.search.projection`), where it expands by scores alone; None otherwise."""
        if not self.strategy.expands_by_scores:
            return None
        return self.strategy.expand([SimpleNamespace(uid=c.uid, subtree=c.subtree, is_done=False, text=c.text,
                                                     score=aggregate(c.scores, self.search.aggregation))
                                     for c in candidates])

    def likely_children(self, live_share: float) -> int:
        """The children a survivor gets were that share of a full step's paths to settle live."""
        return self.strategy.widest_child(max(1, round(self.strategy.n * live_share)))

    def surely_pruned(self, scores: dict[SearchPath, float]) -> set[SearchPath]:
        """Of live paths that ended the step being decoded, with their step's scores (a free verifier's,
        read ahead), those pruned when the step settles whatever the paths still decoding do: the
        strategy's rule over them."""
        views = [SimpleNamespace(uid=p.uid, text=p.text, score=aggregate(p.step_scores + [score], p.aggregation))
                 for p, score in scores.items()]
        pruned = self.strategy.surely_pruned(views)
        return {p for p in scores if p.uid in pruned}
