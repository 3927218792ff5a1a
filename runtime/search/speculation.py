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

How likely a lineage's children are, how many each wants, which paths are surely pruned and in
which order wants are served is the ranking's (`runtime.search.ranking.LineageRanking`): this holds
the lineages and the slots. When a group opens, everything wanted is asked again (`LineageRanking.walk`).
Slots are handed out lazily, as lineages end their steps, to the wants first in the ranking's order.
A lineage that ends a step keeps its slot only where going on is the first thing wanted.
With no slot idle (or the step-cost model's cap reached), a running lineage ranked after a want
yields its slot at its next token: it parks, wanted again as ranked before (`_make_way`), so the
likely children need not wait for unlikely ones to end their steps; so does a lineage below a path
surely pruned, not to be wanted again. Where other work waits, every lineage parks, wanted again
(`pause`), and the engine offers the wants the slots idle again (`refill`).

LookAhead verification (section 4.1.3): a reward model scoring a path whose first step ahead is
complete scores both steps in one sequence (`runtime.search.ahead.lookahead_unit`); if the path goes on to that step its
score is already known. Only a path's own next step is read ahead: it is the one unit whose path
exists when the score is read (a child exists only after settling, and reads its own first score then).
"""

from __future__ import annotations

from typing import Protocol

from runtime.model.sampler import SamplingState
from runtime.search.host import SearchHost
from runtime.search.paths import Branch, Lineage, SearchPath, StepAhead
from runtime.search.plan import SearchPlan
from runtime.search.ranking import LineageRanking, RankingPort
from runtime.search.steps import StepRules
from scheduler.sequence import Sequence


class SpeculationPort(RankingPort, Protocol):
    """What speculation reads of its search (`runtime.search.controller.SearchController`)."""

    host: SearchHost
    plan: SearchPlan
    request_id: str
    rules: StepRules

    def child_sampling(self, parent: Lineage, ordinal: int, at: int | None = None) -> SamplingState: ...

    def count_token(self) -> None: ...


class Speculation:
    """A search's speculative lineages and the slots they hold: which run, their branches and steps
    decoded ahead, what they become; what they want, in order, is its ranking's."""

    def __init__(self, search: SpeculationPort, num_paths: int, beam_width: int, is_enabled: bool) -> None:
        self.search = search
        self.is_enabled = is_enabled
        self.is_open = False  # a step's group is decoding and the step after it is not the last
        self.ranking = LineageRanking(search, self, num_paths, beam_width)
        self.running: dict[Lineage, tuple] = {}  # decoding speculatively now -> its want's (rank, -potential)
        self.yielding: set[Lineage] = set()  # of them, those to give their slot to a want ranked before them
        self.branches: dict[Lineage, dict[tuple[int, int], Branch]] = {}  # lineage -> (fork at, ordinal) -> branch
        self.path_ahead: dict[SearchPath, list[StepAhead]] = {}  # a path's steps decoded past its step's end
        self.head_starts: dict[SearchPath, int] = {}  # its tokens of the step running decoded before it began
        self.tokens = {"used": 0, "discarded": 0, "adopted": 0}
        self.num_decoded = 0  # speculative tokens decoded, kept or not
        self.num_reported = 0  # of them, those the step-cost model has heard of

    @property
    def request_id(self) -> str:
        return self.search.request_id

    # -- the controller's questions ---------------------------------------------------------------
    def open(self, step: list[SearchPath], done: list[SearchPath]) -> None:
        """A step of `step`'s paths starts a group (and a step follows it): its paths may speculate once
        done, and so may the paths in `done`, whose step is done already, and everything below them
        (parked where the last group left them)."""
        self.is_open = self.is_enabled
        self.ranking.open(step, done)
        if self.is_open:
            for path in done:
                self.ranking.walk(path)
            self.path_ended()
            self._fill()

    def on_step_done(self, path: SearchPath) -> bool:
        """`path` ended its step without ending, in the slot it holds: whether speculation took the slot
        (the path goes on past its step, or was parked for a branch wanted more)."""
        if not self.is_open:
            return False
        self.ranking.reached(path, path.step_end, self.search.step_index)
        self._go_on(path)
        return True

    def path_ended(self) -> None:
        """A path ended the step being decoded, or finished (or a group opened): what of the paths
        surely pruned now runs yields its slot at its next token, and where fewer paths may settle
        live, the children the paths that ended the step want more start as slots allow."""
        if not self.is_open:
            return
        wants_more = self.ranking.path_ended()
        self.yielding |= {lineage for lineage in self.running if self.ranking.is_doomed(lineage)}
        if wants_more:
            self._fill()

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
        self.ranking.hand_over(branch, child)
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
        self.ranking.release(lineage)
        self.path_ahead.pop(lineage, None)
        self.head_starts.pop(lineage, None)
        for branch in self.branches.pop(lineage, {}).values():
            self._drop(branch)

    def stop(self) -> None:
        """The step's group is done: every speculative slot is given back, lineages keep their tokens,
        parked, and none starts until the next group."""
        self.is_open = False
        self.ranking.stop()
        for lineage in list(self.running):
            self._end(lineage)

    def pause(self) -> None:
        """Other work waits: every speculative slot is given back; the lineages keep their tokens,
        parked, and are wanted again as they were ranked, to go on in slots idle later (`refill`)."""
        for lineage in list(self.running):
            rank, minus_potential = self.running[lineage]
            self._end(lineage)
            self.ranking.want(self.steps_ahead(lineage)[-1].step, lineage, 0, None, -minus_potential, rank)

    def refill(self) -> bool:
        """Nothing waits and slots are idle: the wanted steps start in them (after a pause). Whether
        it asked for any. Where the step-cost model declines every row and none runs (`auto` on a
        CPU), nothing could start or yield: it returns at once, as it does every step there."""
        host = self.search.host
        if not self.is_open or not self.ranking.has_wants or host.num_idle_slots() <= 0:
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

    def branch(self, lineage: Lineage, at: int, ordinal: int) -> Branch | None:
        """`lineage`'s branch forked at token index `at` for its `ordinal`-th child, if started (read only)."""
        return self.branches.get(lineage, {}).get((at, ordinal))

    def branches_below(self, lineage: Lineage) -> list[Branch]:
        """The branches forked from `lineage` (read only)."""
        return list(self.branches.get(lineage, {}).values())

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
            self.ranking.changed()
            self.ranking.completed(step.step, reason is not None)
            if reason is None:
                step.score = self.search.outlook.score_ahead(step.logprobs)
                self.ranking.reached(lineage, step.end, step.step)
            self._go_on(lineage)
        elif lineage in self.yielding:  # parks, wanted again to decode the rest of its step as ranked before
            rank, minus_potential = self.running[lineage]
            self._end(lineage)
            self.ranking.want(step.step, lineage, 0, None, -minus_potential, rank)
            self._fill(freed=1)
        elif not self._may_run():
            self._end(lineage)

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
        first = self.ranking.first()
        more = 0 if lineage in self.running else 1
        if first is not None and first[4] is lineage and first[2] == 0 and self._may_run(more):
            self.ranking.pop_first()
            self._run(lineage, first[5], first[6], first[:2], resume=False)
            self._fill()
            return
        self._end(lineage)
        self._fill(freed=1)

    def _fill(self, freed: int = 0) -> None:
        """Start the wanted steps the idle slots allow (`freed`: slots given back in this plan, which the
        engine does not count yet), in the ranking's order. With no slot idle (or the cap reached), running
        lineages ranked after the first wants yield their slots (`_make_way`)."""
        self.ranking.put_in_order()
        started = 0
        while self.ranking.has_wants and self.is_open:
            host = self.search.host
            cap = host.speculative_row_cap(self.num_rows)
            if (cap is not None and self.num_rows >= cap) or host.num_idle_slots() + freed <= started:
                self._make_way()
                break
            rank, minus_potential, ordinal, _, lineage, at, step = self.ranking.pop_first()
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
        order = sorted((self.ranking.running_key(lineage, key), i)
                       for i, (lineage, key) in enumerate(self.running.items()) if lineage not in self.yielding)
        lineages = list(self.running)
        for want in self.ranking.leading_keys(len(self.yielding), len(order)):  # the first have their slots coming
            key, i = order.pop()
            if want >= key:
                return
            self.yielding.add(lineages[i])

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
        self.ranking.changed()
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
