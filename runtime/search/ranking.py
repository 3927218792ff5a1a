"""What speculation wants decoded next, ranked (`runtime.search.speculation` holds the slots and the
lineages; this ranks what they may decode).

How likely a lineage's children are is its speculative potential (FlashTTS section 4.1.1): the bin
its score falls in among `beam_width` equal bins of a range of scores (verifiers score in ranges of
their own), the highest bin giving `beam_width`. Where the verifier's score is free to read before
the step settles (`confidence`: the step's own tokens' log-probabilities; `StepOutlook.score_ahead`)
the score is the one the step just completed will get, among that step's scores known so far, at any
depth; otherwise it is the path's last score among the step's paths' last scores, and a branch has
its parent's potential. The first step has no score, and nothing tells its paths apart: they all
count as the highest bin, as do paths whose scores are all equal. Only the lineage itself goes on
where the settling after the step expands nothing (best-of-n, a step granularity leaves unverified).

How many children a survivor gets is the strategy's (`widest_child`): a beam refills all `n` paths
from fewer survivors where paths finished or were duplicates, so a survivor may get more than
`beam_width`. For the step being decoded the controller counts (`children_limit`) how many a
survivor will get at least: as many as were every path still decoding to settle live (no more can
survive); as paths finish, the paths that ended the step want more (`path_ended`). For a later step
the share of the speculative lineages that ended it live makes a count likely (`ChildCounts`), and
as it grows the lineages that completed that step want more (`completed`). Each lineage wants
that many children, those within its potential (scaled to that many) ranked with the next step, the
others with the step after. Where the scores are free, a path that ended the step and is surely
pruned when it settles (`StepOutlook.surely_pruned`) wants nothing more, nor does anything below
it (`is_doomed`: what of it runs yields its slot).

When a group opens, everything wanted is asked again: below each path whose step is done, every
step a lineage completed ahead wants its children (not only its last one), and its last step goes on
(`walk`). Where the scores are free and the strategy expands by scores alone, its settling is
replayed over the steps decoded ahead (`runtime.search.projection`): what that makes paths' steps is
wanted first. Then the nearest rank, then the highest potential, then lower ordinals (going on as
itself first), then in the order asked.
"""

from __future__ import annotations

from typing import Protocol

from runtime.search.anchor import ANCHOR_UID
from runtime.search.child_counts import ChildCounts, CountPort
from runtime.search.outlook import StepOutlook
from runtime.search.paths import Branch, Lineage, SearchPath, StepAhead
from runtime.search.projection import Candidate, Projection, project

# A want: (rank, -potential, ordinal, asked, lineage, fork at, step); `fork at` None: the lineage goes
# on into the step it began.
Want = tuple


class RankingPort(CountPort, Protocol):
    """What the ranking reads of its search (`runtime.search.controller.SearchController`)."""

    step_index: int  # the step its paths are decoding
    outlook: StepOutlook  # what its strategy and verifier say of steps to come


class LineageTree(Protocol):
    """What the ranking reads of the lineages (`runtime.search.speculation.Speculation` owns them)."""

    def steps_ahead(self, lineage: Lineage) -> list[StepAhead]: ...

    def branch(self, lineage: Lineage, at: int, ordinal: int) -> Branch | None: ...

    def branches_below(self, lineage: Lineage) -> list[Branch]: ...


class LineageRanking:
    """A search's speculative wants, ranked: the lineages' potential, the children likely wanted, the
    scores read ahead, the paths surely pruned and the projection of the settling."""

    def __init__(self, search: RankingPort, tree: LineageTree, num_paths: int, beam_width: int) -> None:
        self.search = search
        self.tree = tree
        self.beam_width = beam_width
        self.score_range: tuple[float, float] | None = None  # of the step's paths' last scores
        self.doomed: set[Lineage] = set()  # paths surely pruned at the settling and everything below them
        self.wants: list[Want] = []
        self.num_asked = 0
        self.counts = ChildCounts(search, num_paths)  # step -> the children wanted per lineage at its end
        self.later: dict[int, dict[Lineage, int]] = {}  # a step after the one decoded -> lineages that completed it, at
        self.paths_ended: list[SearchPath] = []  # the paths that ended the step being decoded (`path_ended`)
        self.known: dict[int, dict[tuple[int, ...], float]] = {}  # step -> lineage's seed key -> its free score
        self.projection: Projection | None = None  # the search as the scores read so far settle it (None: to redo)

    # -- what speculation tells it ----------------------------------------------------------------
    def open(self, step: list[SearchPath], done: list[SearchPath]) -> None:
        """A group of `step`'s paths opens; those in `done` ended the step already: nothing is wanted yet."""
        scores = [p.step_scores[-1] for p in step if p.step_scores]
        self.score_range = (min(scores), max(scores)) if scores else None
        self.wants = []
        self.paths_ended = list(done)
        self.projection = None
        self.later = {step: lineages for step, lineages in self.later.items() if step > self.search.step_index}

    def stop(self) -> None:
        """The step's group is done: nothing is wanted (the next group's opening finds it all again;
        the settling releases the doomed)."""
        self.doomed = set()
        self.wants = []

    def changed(self) -> None:
        """A lineage completed a step or a branch started: the projection is redone when next read."""
        self.projection = None

    def hand_over(self, branch: Branch, child: SearchPath) -> None:
        """`child` adopted `branch`: what `branch` completed ahead is the child's."""
        self.projection = None
        for lineages in self.later.values():
            if branch in lineages:
                lineages[child] = lineages.pop(branch)

    def release(self, lineage: Lineage) -> None:
        """`lineage` is dropped: it completes nothing ahead any more."""
        self.projection = None
        for lineages in self.later.values():
            lineages.pop(lineage, None)

    # -- what is wanted ---------------------------------------------------------------------------
    def walk(self, lineage: Lineage) -> None:
        """Want what `lineage` and everything below it may decode next: the step it began, or those
        past the last step it completed."""
        ahead = self.tree.steps_ahead(lineage)
        if isinstance(lineage, SearchPath) and ahead:
            self.reached(lineage, lineage.step_end, self.search.step_index, itself=False)
        for step in ahead[:-1]:  # (it went on past them: they are complete)
            self.reached(lineage, step.end, step.step, itself=False)
        if ahead:
            last = ahead[-1]
            if last.end is None:
                self.want(last.step, lineage, 0, None, self._potential(lineage, last.step - 1))
            elif last.finish is None:
                self.reached(lineage, last.end, last.step)
        elif isinstance(lineage, SearchPath):
            self.reached(lineage, lineage.step_end, self.search.step_index)
        for branch in self.tree.branches_below(lineage):
            self.walk(branch)

    def reached(self, lineage: Lineage, at: int, step: int, itself: bool = True) -> None:
        """`lineage`'s tokens complete step `step` at token index `at` (its score there is known where it
        is free): it may go on as itself, and branches may fork there for the children a survivor will
        get (`_want_children`)."""
        if self.search.outlook.step_shape(step + 1) is None:
            return
        score = self._score(lineage, step)
        if score is not None:
            self.known.setdefault(step, {})[lineage.seed_key] = score
        potential = self._potential(lineage, step)
        if itself:
            self.want(step + 1, lineage, 0, at, potential)
        if isinstance(lineage, SearchPath) and step == self.search.step_index and lineage not in self.paths_ended:
            self.paths_ended.append(lineage)
        if self._expands(lineage, step):
            if step > self.search.step_index:
                self.later.setdefault(step, {})[lineage] = at
            self._want_children(lineage, at, step, potential, 1, self.counts.at(step))

    def path_ended(self) -> bool:
        """A path ended the step being decoded, or finished (or a group opened): the paths surely pruned
        now are doomed (`_doom`), and if fewer paths may settle live, the paths that ended the step want
        more children. Whether it wants more."""
        step = self.search.step_index
        if self.search.outlook.step_shape(step + 1) is None:
            return False
        self._doom()
        self.projection = None
        grown = self.counts.sure_grew()
        if grown is None:
            return False
        before, limit = grown
        for path in self.paths_ended:
            if not path.is_done and self._expands(path, step):
                self._want_children(path, path.step_end, step, self._potential(path, step), before, limit)
        return True

    def completed(self, step: int, finished: bool) -> None:
        """A speculative lineage completed step `step`, `finished` there or not: if that makes more
        children likely for the survivors of a later step, the lineages that completed it want them."""
        grown = self.counts.completed(step, finished)
        if grown is None:
            return
        before, limit = grown
        for lineage, at in list(self.later.get(step, {}).items()):
            if lineage not in self.doomed:
                self._want_children(lineage, at, step, self._potential(lineage, step), before, limit)

    def want(self, step: int, lineage: Lineage, ordinal: int, at: int | None, potential: int,
             rank: int | None = None) -> None:
        """Want `lineage` to decode step `step`: going on (ordinal 0; from `at`, or the step it began
        where None) or as its `ordinal`-th child forked at `at`. Nothing of the doomed is wanted."""
        if lineage in self.doomed:
            return
        if rank is None:
            rank = step + (ordinal >= max(1, potential))  # a child past its potential ranks with the next step
        self.wants.append((rank, -potential, ordinal, self.num_asked, lineage, at, step))
        self.num_asked += 1

    def _doom(self) -> None:
        """The paths that ended the step and are surely pruned when it settles (a free verifier's scores
        tell: `StepOutlook.surely_pruned`) want nothing more, nor does anything below them. (The rule
        takes paths of one text to have one score; were it ever wrong, a child would decode after the
        settling instead of ahead: the same tokens, later.) The scores are those `reached` read; a path
        without one counts as not there, which can only leave a path not doomed."""
        step = self.search.step_index
        known = self.known.get(step, {})
        scores = {p: known[p.seed_key] for p in self.paths_ended
                  if not p.is_done and self._expands(p, step) and p.seed_key in known}
        for path in self.search.outlook.surely_pruned(scores) - self.doomed if scores else ():
            below, todo = set(), [path]
            while todo:
                lineage = todo.pop()
                below.add(lineage)
                todo.extend(self.tree.branches_below(lineage))
            self.doomed |= below
            self.wants = [w for w in self.wants if w[4] not in below]

    def _want_children(self, lineage: Lineage, at: int, step: int, potential: int, first: int, limit: int) -> None:
        """Want `lineage`'s children `first` to `limit` - 1 at step `step`'s end (token index `at`), those
        within its potential (scaled to `limit` children) ranked with the next step, the others after."""
        within = -(-potential * limit // self.beam_width)
        for ordinal in range(first, limit):
            if self.tree.branch(lineage, at, ordinal) is None:
                self.want(step + 1, lineage, ordinal, at, potential, step + 1 + (ordinal >= within))

    def _expands(self, lineage: Lineage, step: int) -> bool:
        """Whether `lineage` may have children at step `step`'s end (the greedy anchor never has)."""
        shape = self.search.outlook.step_shape(step)
        return shape is not None and shape[1] and not (isinstance(lineage, SearchPath) and lineage.uid == ANCHOR_UID)

    def _potential(self, lineage: Lineage, step: int) -> int:
        """Its most children at step `step`'s end: the bin of its score among `beam_width` equal bins of
        the range of scores (the highest: `beam_width`; all of them where the scores do not differ). The
        score is that of the step itself where the verifier's is free to read (`_score`), among the scores
        of that step known so far; otherwise its last score among the step's paths' last scores, a
        branch's its parent's potential. The greedy anchor never has children: it decodes on as itself
        alone."""
        if not self._expands(lineage, step):
            return 1
        score = self._score(lineage, step)
        if score is not None:
            known = [score, *self.known.get(step, {}).values()]
            low, high = min(known), max(known)
        elif isinstance(lineage, Branch):
            return lineage.potential
        elif lineage.step_scores and self.score_range is not None:
            score, (low, high) = lineage.step_scores[-1], self.score_range
        else:
            return self.beam_width
        if high <= low:
            return self.beam_width
        return min(self.beam_width, 1 + int((score - low) / (high - low) * self.beam_width))

    def _score(self, lineage: Lineage, step: int) -> float | None:
        """The verifier's score of `lineage`'s step `step`, where it is free to read before settling
        (`StepOutlook.score_ahead`) and the step is complete; None otherwise."""
        for ahead in self.tree.steps_ahead(lineage):
            if ahead.step == step:
                return ahead.score
        if isinstance(lineage, SearchPath) and step == self.search.step_index and lineage.step_end > lineage.step_start:
            return self.search.outlook.score_ahead(lineage.chunk_logprobs)
        return None

    # -- the order ---------------------------------------------------------------------------------
    def is_doomed(self, lineage: Lineage) -> bool:
        return lineage in self.doomed

    @property
    def has_wants(self) -> bool:
        return bool(self.wants)

    def put_in_order(self) -> None:
        """The wants sorted by their place (`_order`), read afresh."""
        self.wants.sort(key=self._order)

    def first(self) -> Want | None:
        """The want first in order, left wanted."""
        self.put_in_order()
        return self.wants[0] if self.wants else None

    def pop_first(self) -> Want:
        """The want first in order, no longer wanted (after `put_in_order`, `first`, or another pop: the
        order holds)."""
        return self.wants.pop(0)

    def leading_keys(self, skip: int, count: int) -> list[tuple]:
        """The place (`_order`'s first three) of the wants in order after the first `skip`, `count` at most."""
        return [self._order(want)[:3] for want in self.wants[skip:skip + count]]

    def running_key(self, lineage: Lineage, key: tuple) -> tuple:
        """The place of a running lineage whose want had `key` (rank, -potential), as `_order` places wants."""
        return (not self._projected().decodes_path(lineage, self.tree.steps_ahead(lineage)[-1].step), *key)

    def _order(self, want: Want) -> tuple:
        """A want's place: first those the projection makes a path's step, then by rank, potential,
        ordinal and the order asked."""
        rank, minus_potential, ordinal, asked, lineage, at, step = want
        projection = self._projected()
        is_path = projection.decodes_path(lineage, step) if at is None else projection.wants_child(lineage, at, ordinal)
        return not is_path, rank, minus_potential, ordinal, asked

    def _projected(self) -> Projection:
        """The search as the scores read so far settle it (`runtime.search.projection`), from the live
        paths that ended the step being decoded with their free scores."""
        if self.projection is None:
            step = self.search.step_index
            known = self.known.get(step, {})
            first = [Candidate(p, p.step_end, p.step_scores + [known[p.seed_key]], p.text, p.uid, p.subtree)
                     for p in self.paths_ended if not p.is_done and p.seed_key in known and self._expands(p, step)]
            self.projection = project(first, step, self.search.outlook.expansion_ahead, self._goes_on, self._child,
                                      self.tree.steps_ahead)
        return self.projection

    def _goes_on(self, step: int) -> bool:
        shape = self.search.outlook.step_shape(step)
        return shape is not None and shape[1] and self.search.outlook.step_shape(step + 1) is not None

    def _child(self, lineage: Lineage, at: int, ordinal: int) -> Lineage | None:
        return lineage if ordinal == 0 else self.tree.branch(lineage, at, ordinal)
