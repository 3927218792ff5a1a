"""Speculative beam extension (FlashTTS section 4.1): a path done with its step decodes its children's
next steps in idle slots while the rest of its step's group still decodes, and they decode theirs.

A lineage is a path or one of the speculative branches below it. Each branch is one child a lineage
may get when the step it is decoding settles, decoded exactly as that child will decode:
- a lineage goes on past its step's end as itself (a survivor is its own first child: ordinal 0);
- its branch k >= 1 is a fork at that step's end with the k-th new child's sampler seed and grammar
  fork (`SpeculationPort.child_sampling`, the very state the controller gives that child), so its
  tokens are that child's to the bit.
Lineages go on step after step (a `StepAhead` per step, with its end and finish once complete),
and a branch that completes its step gets branches of its own: the children the child will have. So while
one slow path holds its step open, the likely survivors' descendants are decoding several steps
ahead, and the search's decode steps approach its longest path. Verification never sees
speculative tokens. When a step settles, a survivor's k-th child adopts branch k (its steps start
ahead, or are already complete, and its branches become its own), the survivor keeps the steps it
decoded ahead and the branches below them; branches past a survivor's children, and everything
below a pruned path, are released.

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
as it grows the lineages that completed that step want more (`_completed`). Each lineage wants
that many children, those within its potential (scaled to that many) ranked with the next step, the
others with the step after. Where the scores are free, a path that ended the step and is surely
pruned when it settles (`StepOutlook.surely_pruned`) wants nothing more, nor does anything below
it, and what of it runs yields its slot.

When a group opens, everything wanted is asked again: below each path whose step is done, every
step a lineage completed ahead wants its children (not only its last one), and its last step goes on.
Where the scores are free and the strategy expands by scores alone, its settling is replayed over
the steps decoded ahead (`runtime.search.projection`): what that makes paths' steps is wanted first.
Slots are handed out lazily, as lineages end their steps: the projection's first, the nearest rank
next, then the highest potential, then lower ordinals (going on as itself first), then in the order
asked. A lineage that ends a step keeps its slot only where going on is the first thing wanted.
With no slot idle (or the step-cost model's cap reached), a running lineage ranked after a want
yields its slot at its next token: it parks, wanted again as ranked before (`_make_way`), so the
likely children need not wait for unlikely ones to end their steps. Where other work waits, every
lineage parks, wanted again (`pause`), and the engine offers the wants the slots idle again
(`refill`).

LookAhead verification (section 4.1.3): a reward model scoring a path whose first step ahead is
complete scores both steps in one sequence (`runtime.search.ahead.lookahead_unit`); if the path goes on to that step its
score is already known. Only a path's own next step is read ahead: it is the one unit whose path
exists when the score is read (a child exists only after settling, and reads its own first score then).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from runtime.model.detokenizer import StepText
from runtime.model.sampler import SamplingState
from runtime.search.anchor import ANCHOR_UID
from runtime.search.child_counts import ChildCounts
from runtime.search.host import SearchHost
from runtime.search.outlook import StepOutlook
from runtime.search.paths import SearchPath, StepAhead
from runtime.search.plan import SearchPlan
from runtime.search.projection import Candidate, Projection, project
from runtime.search.steps import StepRules
from scheduler.sequence import Sequence


class SpeculationPort(Protocol):
    """What speculation reads of its search (`runtime.search.controller.SearchController`)."""

    host: SearchHost
    plan: SearchPlan
    request_id: str
    step_index: int  # the step its paths are decoding

    rules: StepRules
    outlook: StepOutlook  # what its strategy and verifier say of steps to come

    def child_sampling(self, parent: "SearchPath | Branch", ordinal: int, at: int | None = None) -> SamplingState: ...

    def count_token(self) -> None: ...

    def children_limit(self, step: int) -> int: ...  # the fewest children a survivor of the step gets




@dataclass(eq=False)
class Branch:
    """A fork at token index `start` (a lineage's step's end) decoding as that lineage's child with
    seed key `seed_key` (an owner of a sequence)."""

    speculation: "Speculation"
    seed_key: tuple[int, ...]
    start: int
    seq: Sequence
    sampling: SamplingState
    potential: int  # its parent's, at the step's end it forked from
    ahead: list[StepAhead]
    step_text: StepText | None = None

    @property
    def request_id(self) -> str:
        return self.speculation.search.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.seq.token_ids) - self.start

    def child_seed_key(self, ordinal: int, at: int) -> tuple[int, ...]:
        return self.seed_key + (at, ordinal)  # as its child's will be (SearchPath.child_seed_key)

    def on_logits(self, seq, row):
        return [seq]

    def on_sampled(self, seq, out) -> None:
        self.speculation.on_token(self, out)


Lineage = SearchPath | Branch


class Speculation:
    """A search's speculative lineages: which run, their branches and potential, what they become."""

    def __init__(self, search: SpeculationPort, num_paths: int, beam_width: int, is_enabled: bool) -> None:
        self.search = search
        self.beam_width = beam_width
        self.is_enabled = is_enabled
        self.is_open = False  # a step's group is decoding and the step after it is not the last
        self.score_range: tuple[float, float] | None = None  # of the step's paths' last scores
        self.running: dict[Lineage, tuple] = {}  # decoding speculatively now -> its want's (rank, -potential)
        self.yielding: set[Lineage] = set()  # of them, those to give their slot to a want ranked before them
        self.doomed: set[Lineage] = set()  # paths surely pruned at the settling and everything below them
        self.branches: dict[Lineage, dict[tuple[int, int], Branch]] = {}  # lineage -> (fork at, ordinal) -> branch
        self.wants: list[tuple] = []  # (rank, -potential, ordinal, asked, lineage, fork at, step)
        self.counts = ChildCounts(search, num_paths)  # step -> the children wanted per lineage at its end
        self.later: dict[int, dict[Lineage, int]] = {}  # a step after the one decoded -> lineages that completed it, at
        self.reached: list[SearchPath] = []  # the paths that ended the step being decoded (`path_ended`)
        self.known: dict[int, dict[tuple[int, ...], float]] = {}  # step -> lineage's seed key -> its free score
        self.num_asked = 0
        self.projection: Projection | None = None  # the search as the scores read so far settle it (None: to redo)
        self.path_ahead: dict[SearchPath, list[StepAhead]] = {}  # a path's steps decoded past its step's end
        self.head_starts: dict[SearchPath, int] = {}  # its tokens of the step running decoded before it began
        self.tokens = {"used": 0, "discarded": 0, "adopted": 0}
        self.num_decoded = 0  # speculative tokens decoded, kept or not
        self.num_reported = 0  # of them, those the step-cost model has heard of

    # -- the controller's questions ---------------------------------------------------------------
    def open(self, step: list[SearchPath], done: list[SearchPath]) -> None:
        """A step of `step`'s paths starts a group (and a step follows it): its paths may speculate once
        done, and so may the paths in `done`, whose step is done already, and everything below them
        (parked where the last group left them)."""
        self.is_open = self.is_enabled
        scores = [p.step_scores[-1] for p in step if p.step_scores]
        self.score_range = (min(scores), max(scores)) if scores else None
        self.wants = []
        self.reached = list(done)
        self.projection = None
        self.later = {step: lineages for step, lineages in self.later.items() if step > self.search.step_index}
        if self.is_open:
            for path in done:
                self._walk(path)
            self.path_ended()
            self._fill()

    def on_step_done(self, path: SearchPath) -> bool:
        """`path` ended its step without ending, in the slot it holds: whether speculation took the slot
        (the path goes on past its step, or was parked for a branch wanted more)."""
        if not self.is_open:
            return False
        self._reached(path, path.step_end, self.search.step_index)
        self._go_on(path)
        return True

    def adopt(self, parent: SearchPath, ordinal: int) -> Branch | None:
        """The branch decoding `parent`'s `ordinal`-th new child, handed over (None: there is none); the
        child takes its steps ahead (`adopted`), and its branches with `hand_over`."""
        branch = self.branches.get(parent, {}).pop((parent.step_end, ordinal), None)
        if branch is not None:
            for step in branch.ahead:
                step.adopted = True
        return branch

    def hand_over(self, branch: Branch, child: SearchPath) -> None:
        """`child` adopted `branch`: the branches below it are the child's."""
        below = self.branches.pop(branch, None)
        self.path_ahead[child] = branch.ahead
        self.projection = None
        for lineages in self.later.values():
            if branch in lineages:
                lineages[child] = lineages.pop(branch)
        if below:
            self.branches[child] = below

    def release_unadopted(self, parent: SearchPath) -> None:
        """The branches at `parent`'s step's end that no child took; those below the steps it decoded
        ahead stay (it goes on as itself)."""
        mine = self.branches.get(parent, {})
        for key in [k for k in mine if k[0] == parent.step_end]:
            self._drop(mine.pop(key))
        if not mine:
            self.branches.pop(parent, None)

    def release(self, lineage: Lineage) -> None:
        """Everything below `lineage` is dropped (it was pruned, or ends)."""
        self.projection = None
        self.path_ahead.pop(lineage, None)
        self.head_starts.pop(lineage, None)
        for lineages in self.later.values():
            lineages.pop(lineage, None)
        for branch in self.branches.pop(lineage, {}).values():
            self._drop(branch)

    def stop(self) -> None:
        """The step's group is done: every speculative slot is given back, lineages keep their tokens,
        parked, and none starts until the next group."""
        self.is_open = False
        self.doomed = set()  # (the next group's opening finds them again; the settling releases them)
        self.wants = []
        for lineage in list(self.running):
            self._end(lineage)

    def pause(self) -> None:
        """Other work waits: every speculative slot is given back; the lineages keep their tokens,
        parked, and are wanted again as they were ranked, to go on in slots idle later (`refill`)."""
        for lineage in list(self.running):
            rank, minus_potential = self.running[lineage]
            self._end(lineage)
            if lineage not in self.doomed:
                self._want(self.steps_ahead(lineage)[-1].step, lineage, 0, None, -minus_potential, rank)

    def refill(self) -> bool:
        """Nothing waits and slots are idle: the wanted steps start in them (after a pause). Whether
        it asked for any. Where the step-cost model declines every row and none runs (`auto` on a
        CPU), nothing could start or yield: it returns at once, as it does every step there."""
        host = self.search.host
        if not self.is_open or not self.wants or host.num_idle_slots() <= 0:
            return False
        if not self.running and host.speculative_row_cap(0) == 0:
            return False
        self._fill()
        return True

    def group_done(self, last: SearchPath) -> None:
        """A group of the step is done, `last` its last path to finish: the head start that path had
        shortened the group by as many decode steps (at least: without it, it alone would have run that
        much longer). The step-cost model hears it with the speculative tokens decoded since it last
        heard (scheduler.step_cost), so `auto` learns within a search what speculation saves."""
        head_start = self.head_starts.get(last, 0)
        if self.num_decoded > self.num_reported or head_start:
            self.search.host.observe_speculation(head_start, self.num_decoded - self.num_reported)
            self.num_reported = self.num_decoded

    def is_running(self, path: SearchPath) -> bool:
        """Whether `path` decodes past its step's end in a slot of speculation's."""
        return path in self.running

    def steps_ahead(self, lineage: Lineage) -> list[StepAhead]:
        """The steps `lineage` decoded past its step's end, in order (read only)."""
        return lineage.ahead if isinstance(lineage, Branch) else self.path_ahead.get(lineage, [])

    def take_step(self, path: SearchPath) -> StepAhead | None:
        """The step `path` starts now, where it decoded it ahead (in part, or whole): handed over and
        counted (`used`, or `adopted` from a branch); its head start is kept for `group_done`."""
        ahead = self.path_ahead.get(path)
        if not ahead:
            self.head_starts[path] = 0
            return None
        step = ahead.pop(0)
        self.head_starts[path] = (len(path.seq.token_ids) if step.end is None else step.end) - step.start
        self.count("adopted" if step.adopted else "used", self.head_starts[path])
        return step

    def sequences(self) -> list[Sequence]:
        return [b.seq for below in self.branches.values() for b in below.values()]

    # -- tokens -----------------------------------------------------------------------------------
    def on_token(self, lineage: Lineage, out) -> None:
        """A speculative token of `lineage` (a path past its step's end, or a branch)."""
        self.search.count_token()
        self.num_decoded += 1
        step = self.steps_ahead(lineage)[-1]
        if out.logprob is not None:
            step.logprobs.append(out.logprob)
        runs_to_end = self.search.outlook.step_shape(step.step)[0]
        reason, ends_step = self.search.rules.outcome(lineage, out.token_id, step.start, is_last_step=runs_to_end)
        if reason is not None or ends_step:
            step.end, step.finish = len(lineage.seq.token_ids), reason
            self.projection = None
            self._completed(step.step, reason is not None)
            if reason is None:
                step.score = self.search.outlook.score_ahead(step.logprobs)
                self._reached(lineage, step.end, step.step)
            self._go_on(lineage)
        elif lineage in self.yielding:  # parks, wanted again to decode the rest of its step as ranked before
            rank, minus_potential = self.running[lineage]
            self._end(lineage)
            if lineage not in self.doomed:
                self._want(step.step, lineage, 0, None, -minus_potential, rank)
            self._fill(freed=1)
        elif not self._may_run():
            self._end(lineage)

    # -- what is wanted ---------------------------------------------------------------------------
    def _walk(self, lineage: Lineage) -> None:
        """Want what `lineage` and everything below it may decode next: the step it began, or those
        past the last step it completed."""
        if isinstance(lineage, SearchPath) and self.steps_ahead(lineage):
            self._reached(lineage, lineage.step_end, self.search.step_index, itself=False)
        for ahead in self.steps_ahead(lineage)[:-1]:  # (it went on past them: they are complete)
            self._reached(lineage, ahead.end, ahead.step, itself=False)
        if self.steps_ahead(lineage):
            last = self.steps_ahead(lineage)[-1]
            if last.end is None:
                self._want(last.step, lineage, 0, None, self._potential(lineage, last.step - 1))
            elif last.finish is None:
                self._reached(lineage, last.end, last.step)
        elif isinstance(lineage, SearchPath):
            self._reached(lineage, lineage.step_end, self.search.step_index)
        for branch in list(self.branches.get(lineage, {}).values()):
            self._walk(branch)

    def _reached(self, lineage: Lineage, at: int, step: int, itself: bool = True) -> None:
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
            self._want(step + 1, lineage, 0, at, potential)
        if isinstance(lineage, SearchPath) and step == self.search.step_index and lineage not in self.reached:
            self.reached.append(lineage)
        if self._expands(lineage, step):
            if step > self.search.step_index:
                self.later.setdefault(step, {})[lineage] = at
            self._want_children(lineage, at, step, potential, 1, self.counts.at(step))

    def path_ended(self) -> None:
        """A path ended the step being decoded, or finished (or a group opened): the paths surely pruned
        now stop (`_doom`), and if fewer paths may settle live, the paths that ended the step want more
        children."""
        step = self.search.step_index
        if not self.is_open or self.search.outlook.step_shape(step + 1) is None:
            return
        self._doom()
        self.projection = None
        grown = self.counts.sure_grew()
        if grown is None:
            return
        before, limit = grown
        for path in self.reached:
            if not path.is_done and self._expands(path, step):
                self._want_children(path, path.step_end, step, self._potential(path, step), before, limit)
        self._fill()

    def _completed(self, step: int, finished: bool) -> None:
        """A speculative lineage completed step `step`, `finished` there or not: if that makes more
        children likely for the survivors of a later step, the lineages that completed it want them."""
        grown = self.counts.completed(step, finished)
        if grown is None:
            return
        before, limit = grown
        for lineage, at in list(self.later.get(step, {}).items()):
            if lineage not in self.doomed:
                self._want_children(lineage, at, step, self._potential(lineage, step), before, limit)

    def _doom(self) -> None:
        """The paths that ended the step and are surely pruned when it settles (a free verifier's scores
        tell: `StepOutlook.surely_pruned`) want nothing more, nor does anything below them; what of
        it runs yields its slot at its next token, not to be wanted again. (The rule takes paths of one
        text to have one score; were it ever wrong, a child would decode after the settling instead of
        ahead: the same tokens, later.) The scores are those `_reached` read; a path without one counts
        as not there, which can only leave a path not doomed."""
        step = self.search.step_index
        known = self.known.get(step, {})
        scores = {p: known[p.seed_key] for p in self.reached
                  if not p.is_done and self._expands(p, step) and p.seed_key in known}
        for path in self.search.outlook.surely_pruned(scores) - self.doomed if scores else ():
            below, todo = set(), [path]
            while todo:
                lineage = todo.pop()
                below.add(lineage)
                todo.extend(self.branches.get(lineage, {}).values())
            self.doomed |= below
            self.wants = [w for w in self.wants if w[4] not in below]
            self.yielding |= below & self.running.keys()

    def _want_children(self, lineage: Lineage, at: int, step: int, potential: int, first: int, limit: int) -> None:
        """Want `lineage`'s children `first` to `limit` - 1 at step `step`'s end (token index `at`), those
        within its potential (scaled to `limit` children) ranked with the next step, the others after."""
        within = -(-potential * limit // self.beam_width)
        have = self.branches.get(lineage, {})
        for ordinal in range(first, limit):
            if (at, ordinal) not in have:
                self._want(step + 1, lineage, ordinal, at, potential, step + 1 + (ordinal >= within))

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
        for ahead in self.steps_ahead(lineage):
            if ahead.step == step:
                return ahead.score
        if isinstance(lineage, SearchPath) and step == self.search.step_index and lineage.step_end > lineage.step_start:
            return self.search.outlook.score_ahead(lineage.chunk_logprobs)
        return None

    def _want(self, step: int, lineage: Lineage, ordinal: int, at: int | None, potential: int,
              rank: int | None = None) -> None:
        if lineage in self.doomed:
            return
        if rank is None:
            rank = step + (ordinal >= max(1, potential))  # a child past its potential ranks with the next step
        self.wants.append((rank, -potential, ordinal, self.num_asked, lineage, at, step))
        self.num_asked += 1

    # -- slots ------------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return len(self.running)

    def _may_run(self, more: int = 0) -> bool:
        """Whether `more` speculative rows may be added (none: whether the running ones may go on): the
        step's group is decoding, nothing else wants the slots, and the step-cost model says the rows pay."""
        host = self.search.host
        if not self.is_open or not host.has_idle_slot():
            return False
        cap = host.speculative_row_cap(self.num_rows)
        return cap is None or self.num_rows + more <= cap

    def _go_on(self, lineage: Lineage) -> None:
        """`lineage`, holding a slot, completed a step (or ended): it goes on as itself where that is the
        first thing wanted, else its slot goes to what is."""
        self.wants.sort(key=self._order)
        first = self.wants[0] if self.wants else None
        more = 0 if lineage in self.running else 1
        if first is not None and first[4] is lineage and first[2] == 0 and self._may_run(more):
            self.wants.pop(0)
            self._run(lineage, first[5], first[6], first[:2], resume=False)
            self._fill()
            return
        self._end(lineage)
        self._fill(freed=1)

    def _fill(self, freed: int = 0) -> None:
        """Start the wanted steps the idle slots allow (`freed`: slots given back in this plan, which the
        engine does not count yet), the projection's first, then the nearest step and highest potential.
        With no slot idle (or the cap reached), running lineages ranked after the first wants yield their
        slots (`_make_way`)."""
        self.wants.sort(key=self._order)
        started = 0
        while self.wants and self.is_open:
            host = self.search.host
            cap = host.speculative_row_cap(self.num_rows)
            if (cap is not None and self.num_rows >= cap) or host.num_idle_slots() + freed <= started:
                self._make_way()
                break
            rank, minus_potential, ordinal, _, lineage, at, step = self.wants.pop(0)
            if ordinal and (at, ordinal) in self.branches.get(lineage, {}):
                continue  # wanted again (sooner) and started meanwhile
            if ordinal == 0:
                self._run(lineage, at, step, (rank, minus_potential))
            else:
                self._start_branch(lineage, at, ordinal, step, (rank, minus_potential))
            started += 1  # its fork or resume runs once the engine carries the plan out

    def _make_way(self) -> None:
        """No slot is idle: the running lineages ranked after wants yield their slots to them, each at
        its next token (then it parks, wanted again as it was), the last ranked first."""
        projection = self._projected()
        order = sorted(((not projection.decodes_path(lineage, self.steps_ahead(lineage)[-1].step), *key), i)
                       for i, (lineage, key) in enumerate(self.running.items()) if lineage not in self.yielding)
        lineages = list(self.running)
        for want in self.wants[len(self.yielding):len(self.yielding) + len(order)]:  # the first have their slots coming
            key, i = order.pop()
            if self._order(want)[:3] >= key:
                return
            self.yielding.add(lineages[i])

    def _order(self, want: tuple) -> tuple:
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
                     for p in self.reached if not p.is_done and p.seed_key in known and self._expands(p, step)]
            self.projection = project(first, step, self.search.outlook.expansion_ahead, self._goes_on, self._child,
                                      self.steps_ahead)
        return self.projection

    def _goes_on(self, step: int) -> bool:
        shape = self.search.outlook.step_shape(step)
        return shape is not None and shape[1] and self.search.outlook.step_shape(step + 1) is not None

    def _child(self, lineage: Lineage, at: int, ordinal: int) -> Lineage | None:
        return lineage if ordinal == 0 else self.branches.get(lineage, {}).get((at, ordinal))

    def _run(self, lineage: Lineage, at: int | None, step: int, key: tuple, resume: bool = True) -> None:
        """`lineage` decodes on: into step `step` from `at` (None: the step it began)."""
        if at is not None:
            (lineage.ahead if isinstance(lineage, Branch) else self.path_ahead.setdefault(lineage, [])).append(
                StepAhead(at, step))
        self.running[lineage] = key
        self.yielding.discard(lineage)  # (going on as the first thing wanted)
        if resume:
            self.search.plan.resume(lineage.seq)

    def _start_branch(self, parent: Lineage, at: int, ordinal: int, step: int, key: tuple) -> None:
        seq = self.search.plan.fork(parent.seq, at)
        branch = Branch(self, parent.child_seed_key(ordinal, at), at, seq,
                        self.search.child_sampling(parent, ordinal, at), -key[1], [StepAhead(at, step)])
        seq.own(branch)
        self.projection = None
        self.branches.setdefault(parent, {})[(at, ordinal)] = branch
        self.running[branch] = key
        self.search.plan.resume(seq)

    def _end(self, lineage: Lineage) -> None:
        self.running.pop(lineage, None)
        self.yielding.discard(lineage)
        self.search.plan.park(lineage.seq)

    def count(self, outcome: str, num_tokens: int) -> None:
        """Speculative tokens by what became of them: `used` by their path, `adopted` by its children,
        `discarded`; the search tells which when it settles a step or drops a path."""
        self.tokens[outcome] += num_tokens

    def _drop(self, branch: Branch) -> None:
        self.release(branch)
        self.count("discarded", branch.num_tokens)
        self.running.pop(branch, None)
        self.search.plan.release(branch.seq)
