"""Speculation's ranking on its own (runtime.search.ranking): the wants a step's end makes, in the exact
order slots are handed out, and the paths surely pruned wanting nothing more. Its ports are small
stand-ins; the searches that run it through the engine are tests/runtime/search/test_speculation.py."""

from __future__ import annotations

from types import SimpleNamespace

from runtime.search.paths import SearchPath
from runtime.search.ranking import LineageRanking
from scheduler.sequence import Sequence


class Outlook:
    """Four steps, each expanded at its settling; a step's free score is its log-probabilities' sum."""

    def __init__(self, is_free: bool, pruned_below: float | None = None) -> None:
        self.is_free = is_free
        self.pruned_below = pruned_below

    def step_shape(self, step: int):
        return (False, True) if step < 4 else None

    def score_ahead(self, logprobs):
        return sum(logprobs) if self.is_free else None

    def expansion_ahead(self, candidates):
        return None  # no projection: wants are ordered by rank, potential, ordinal, order asked

    def surely_pruned(self, scores):
        return {path for path, score in scores.items() if self.pruned_below is not None and score < self.pruned_below}


class Tree:
    """No lineage has decoded ahead or forked yet."""

    def steps_ahead(self, lineage):
        return []

    def branch(self, lineage, at, ordinal):
        return None

    def branches_below(self, lineage):
        return []


def search(outlook: Outlook):
    return SimpleNamespace(step_index=0, outlook=outlook, children_limit=lambda step: 3,
                           likely_children=lambda share: 3)


def path(uid: int, last_score: float, logprobs: list[float]) -> SearchPath:
    return SearchPath(None, uid, uid, Sequence([1, 2, 3, 4]), None, "last", step_start=2, step_end=4,
                      step_scores=[last_score], chunk_logprobs=list(logprobs), seed_key=(uid,))


def test_a_step_end_wants_its_lineage_on_and_its_children_ranked_by_potential():
    """Two paths end step 0 at token 4; three children each (`children_limit`), beam width 2. The better
    path (last score 0.9 of 0.1..0.9) has potential 2, so all its three children rank with the next
    step; the worse has potential 1: its first child too (1 x 3 / 2 rounded up is 2 within), its
    second ranks a step later."""
    good, bad = path(1, 0.9, [-0.5]), path(2, 0.1, [-0.5])
    ranking = LineageRanking(search(Outlook(is_free=False)), Tree(), num_paths=4, beam_width=2)
    ranking.open([good, bad], [])
    ranking.reached(bad, 4, 0)
    ranking.reached(good, 4, 0)
    first = ranking.first()
    assert (first[4], first[2]) == (good, 0)  # going on as itself first
    assert ranking.leading_keys(1, 2) == [(True, 1, -2), (True, 1, -2)]
    order = []
    while ranking.has_wants:
        rank, minus_potential, ordinal, _, lineage, at, step = ranking.pop_first()
        order.append((lineage.uid, ordinal, rank, -minus_potential, at, step))
    assert order == [(1, 0, 1, 2, 4, 1), (1, 1, 1, 2, 4, 1), (1, 2, 1, 2, 4, 1),
                     (2, 0, 1, 1, 4, 1), (2, 1, 1, 1, 4, 1), (2, 2, 2, 1, 4, 1)]
    assert ranking.paths_ended == [bad, good]


def test_a_path_surely_pruned_wants_nothing_more():
    """With free scores (the steps' log-probabilities), the path whose score the outlook surely prunes
    loses its wants when a path ends the step, and is never wanted again; the other keeps all three."""
    good, bad = path(1, 0.0, [-0.1]), path(2, 0.0, [-2.0])
    ranking = LineageRanking(search(Outlook(is_free=True, pruned_below=-1.0)), Tree(), num_paths=4, beam_width=2)
    ranking.open([good, bad], [])
    ranking.reached(bad, 4, 0)
    ranking.reached(good, 4, 0)
    assert ranking.known == {0: {(2,): -2.0, (1,): -0.1}}
    assert ranking.path_ended() is False  # the sure count (3) did not grow: nothing more wanted
    assert ranking.is_doomed(bad) and not ranking.is_doomed(good)
    ranking.want(1, bad, 0, 4, 2)
    wanted = []
    while ranking.has_wants:
        want = ranking.pop_first()
        wanted.append((want[4].uid, want[2]))
    assert wanted == [(1, 0), (1, 1), (1, 2)]
