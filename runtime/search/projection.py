"""The search as the scores read so far would settle it (runtime.search.speculation): where the
verifier's scores are free to read before a step settles (`confidence`), and the strategy expands by
scores alone (beam search, dynamic branching), its own expansion is replayed over the steps decoded
ahead, step after step, to tell which lineages would become paths and with how many children.

The first level is the live paths that ended the step being decoded, with the scores their step will
get; paths still decoding count as not there (they may only add competitors, so the projection can
be wrong, never unsafe: it only orders what speculation decodes first). Each projected survivor's
children are itself going on (ordinal 0) and its branches 1 to count - 1; those whose step ahead is
complete and live, with its score, are the next level, numbered as the settling would number them
(a survivor keeps its uid, its new children take new ones in order). A level whose children have not
completed their step yet ends the projection there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.search.paths import StepAhead
from runtime.search.strategies import Expansion

# The new children's uids in a projection: above any uid a search hands out.
FIRST_PROJECTED_UID = 1 << 40


@dataclass
class Candidate:
    """A lineage that completed a step live at token index `at`, with its scores to that step."""

    lineage: object  # a SearchPath or a speculative Branch: its `.seq.token_ids` (its steps ahead: `steps_ahead`)
    at: int
    scores: list[float]
    text: object  # equal for paths of equal text (a path's text, or its parent's and the step's tokens)
    uid: int
    subtree: int = 0


@dataclass
class Projection:
    children: dict[tuple[int, int], int] = field(default_factory=dict)  # (id(lineage), at) -> its children
    paths: set[tuple[int, int]] = field(default_factory=set)  # (id(lineage), step): it decodes a path's step

    def wants_child(self, lineage: object, at: int, ordinal: int) -> bool:
        """Whether `lineage`'s `ordinal`-th child at token index `at` (its step's end) is projected a path."""
        return self.children.get((id(lineage), at), 0) > ordinal

    def decodes_path(self, lineage: object, step: int) -> bool:
        """Whether `lineage`'s step `step` (the one it is decoding) is projected a path's."""
        return (id(lineage), step) in self.paths


def project(first: list[Candidate], step: int, expand: Callable[[list[Candidate]], Expansion | None],
            goes_on: Callable[[int], bool], child: Callable[[object, int, int], object | None],
            steps_ahead: Callable[[object], list[StepAhead]] = lambda lineage: lineage.ahead) -> Projection:
    """Replay `expand` (the strategy's expansion of these candidates; None: it is not replayed) from the
    candidates `first` of step `step`; `goes_on(step)`: whether its settling expands and a step follows;
    `child(lineage, at, k)`: its branch k at `at`, if started (k = 0: the lineage itself);
    `steps_ahead(lineage)`: the steps it decoded ahead (speculation holds a path's; a branch's `ahead`)."""
    projection = Projection()
    level, next_uid = first, FIRST_PROJECTED_UID
    while level and goes_on(step):
        by_uid = {c.uid: c for c in level}
        following = []
        expansion = expand(level)
        if expansion is None:
            break
        for uid, count in zip(expansion.parents, expansion.children):
            parent = by_uid[uid]
            projection.children[(id(parent.lineage), parent.at)] = count
            for ordinal in range(count):
                child_uid = uid
                if ordinal:
                    child_uid, next_uid = next_uid, next_uid + 1
                lineage = child(parent.lineage, parent.at, ordinal)
                ahead = _step_from(lineage, parent.at, steps_ahead)
                if ahead is None:
                    continue
                projection.paths.add((id(lineage), step + 1))
                if ahead.end is not None and ahead.finish is None and ahead.score is not None:
                    tokens = tuple(lineage.seq.token_ids[parent.at:ahead.end])
                    following.append(Candidate(lineage, ahead.end, parent.scores + [ahead.score],
                                               (parent.text, tokens), child_uid, parent.subtree))
        level, step = following, step + 1
    return projection


def _step_from(lineage: object | None, at: int, steps_ahead: Callable[[object], list[StepAhead]]) -> StepAhead | None:
    """The step `lineage` decoded ahead from token index `at`, if it began it."""
    if lineage is None:
        return None
    return next((ahead for ahead in steps_ahead(lineage) if ahead.start == at), None)
