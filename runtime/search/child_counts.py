"""How many children speculation decodes ahead for a lineage that completed a step
(runtime.search.speculation): the children a survivor of that step will get.

A survivor's children are the strategy's (`Strategy.widest_child`): a beam refills all `n` paths from
its survivors, so where fewer paths settle live (they finished, or were duplicates) each gets more.
- For the step being decoded the count is sure (`SpeculationPort.children_limit`): as many as were
  every path still decoding to settle live beside those live at its end. It grows as paths finish.
- For a later step nothing is sure yet, but the speculative lineages that completed it tell how its
  paths tend to end: the share of them that ended it live, of `n` paths, is its likely live count,
  and the children that count gives are wanted (`SpeculationPort.likely_children`), once as many
  lineages as half a step's paths have completed it (fewer tell the share too roughly: see
  docs/speculation.md). It grows as more finish there, never shrinks: a lineage's branches already
  started stay.
"""

from __future__ import annotations

from typing import Protocol


class CountPort(Protocol):
    step_index: int  # the step being decoded

    def children_limit(self, step: int) -> int: ...  # the fewest children a survivor of the step gets

    def likely_children(self, live_share: float) -> int: ...  # a survivor's children where that share settles live


class ChildCounts:
    """Per step, the children each lineage that completed it wants."""

    def __init__(self, search: CountPort, num_paths: int) -> None:
        self.search = search
        self.min_outcomes = max(2, num_paths // 2)  # completions of a later step before they tell its share
        self.counts: dict[int, int] = {}  # step -> children wanted at its end
        self.outcomes: dict[int, list[int]] = {}  # later step -> [lineages that ended it live, that finished there]

    def at(self, step: int) -> int:
        """The children a lineage that completed `step` wants now."""
        if step not in self.counts:
            self.counts[step] = max(self.search.children_limit(step), self._likely(step))
        return self.counts[step]

    def sure_grew(self) -> tuple[int, int] | None:
        """The step being decoded's sure count, again (a path ended it, or finished): (before, now)
        where it grew."""
        step = self.search.step_index
        return self._grow(step, self.search.children_limit(step))

    def completed(self, step: int, finished: bool) -> tuple[int, int] | None:
        """A speculative lineage completed later step `step` (`finished`: its path ended there):
        (before, now) where the likely count grew."""
        if step <= self.search.step_index:
            return None
        outcome = self.outcomes.setdefault(step, [0, 0])
        outcome[finished] += 1
        return self._grow(step, self._likely(step))

    def _grow(self, step: int, count: int) -> tuple[int, int] | None:
        before = self.at(step)
        if count <= before:
            return None
        self.counts[step] = count
        return before, count

    def _likely(self, step: int) -> int:
        live, finished = self.outcomes.get(step, (0, 0))
        if live + finished < self.min_outcomes or step <= self.search.step_index:
            return 0
        return self.search.likely_children(live / (live + finished))
