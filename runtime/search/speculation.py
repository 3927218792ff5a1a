"""Speculative beam extension (FlashTTS section 4.1): a path done with its step decodes its children's
next steps in idle slots while the rest of its step's group still decodes.

Each of a path's speculative branches is one child it may get when the step settles, decoded
exactly as that child will decode:
- branch 0 is the path itself, decoding on past `step_end` with its own sampler (a survivor is its
  own last child);
- branch k >= 1 is a fork at `step_end` with the k-th new child's sampler seed and grammar fork
  (`SpeculationPort.child_sampling`, the very state the controller gives that child), so its
  tokens are that child's to the bit.
A branch decodes to its step's end (or its path's), then parks with how it ended. Verification never
sees speculative tokens. When the step settles, a survivor's k-th child adopts branch k (its step
starts ahead, or is already complete) and branch 0's tokens stay with the survivor; branches past a
survivor's children, and every branch of a pruned path, are released.

How many branches a path may get is its speculative potential (FlashTTS section 4.1.1): the bin its
last step score falls in among `beam_width` equal bins of the range of the step's paths' last scores
(verifiers score in ranges of their own), the highest bin giving `beam_width` branches. The first
step has no score, and nothing tells its paths apart: they all count as the highest bin (every
path's children are as many as any step's), as do paths whose scores are all equal.
Only branch 0 runs where the next settling expands nothing (best-of-n, a step granularity leaves
unverified). Idle slots are handed out lazily, as paths end their steps and branches end theirs:
highest potential first, then lower ordinals, then in the order the paths ended.

LookAhead verification (section 4.1.3): a reward model scoring a path whose branch 0 completes its
next step scores both steps in one sequence (`lookahead_unit`); if the path goes on to that step its
score is already known. Only branch 0 is read ahead: it is the one unit whose path exists when the
score is read (a child exists only after settling, and reads its own first score then).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from runtime.model.detokenizer import StepText
from runtime.model.sampler import SamplingState
from runtime.search.anchor import ANCHOR_UID
from runtime.search.aggregate import normalize_step
from runtime.search.host import SearchHost
from runtime.search.paths import SearchPath
from runtime.search.plan import SearchPlan
from runtime.search.steps import StepRules
from scheduler.sequence import Sequence


class SpeculationPort(Protocol):
    """What speculation reads of its search (`runtime.search.controller.SearchController`)."""

    host: SearchHost
    plan: SearchPlan
    request_id: str

    rules: StepRules

    def child_sampling(self, parent: SearchPath, ordinal: int) -> SamplingState: ...

    def count_token(self) -> None: ...


@dataclass(eq=False)
class Branch:
    """A fork of `parent` at its step's end decoding as its `ordinal`-th new child (an owner of a sequence)."""

    speculation: "Speculation"
    parent: SearchPath
    ordinal: int
    seq: Sequence
    sampling: SamplingState
    logprobs: list[float] = field(default_factory=list)
    outcome: str | None = None  # "step" once its tokens complete the child's step
    finish: str | None = None  # and the child's finish reason if it ends there
    step_text: StepText | None = None

    @property
    def request_id(self) -> str:
        return self.speculation.search.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.seq.token_ids) - self.parent.step_end

    def on_logits(self, seq, row):
        return [seq]

    def on_sampled(self, seq, out) -> None:
        self.speculation.on_branch_token(self, out)


class Speculation:
    """A search's speculative branches: which run, their potential, what they become."""

    def __init__(self, search: SpeculationPort, beam_width: int, is_enabled: bool) -> None:
        self.search = search
        self.beam_width = beam_width
        self.is_enabled = is_enabled
        self.is_open = False  # a step's group is decoding and the step after it is not the last
        self.expands_next = False  # whether the step being decoded ends in an expansion
        self.is_last_next = False  # whether the next step is the search's last (no step delimiter)
        self.score_range: tuple[float, float] | None = None  # of the step's paths' last scores
        self.speculating: set[SearchPath] = set()  # paths decoding past their step (branch 0)
        self.branches: dict[SearchPath, dict[int, Branch]] = {}  # parent -> ordinal -> its branch
        self.running: set[Branch] = set()
        self.wants: list[tuple[int, int, int, SearchPath]] = []  # (-potential, ordinal, asked, parent)
        self.num_asked = 0
        self.tokens = {"used": 0, "discarded": 0, "adopted": 0}
        self.num_decoded = 0  # speculative tokens decoded, kept or not
        self.num_reported = 0  # of them, those the step-cost model has heard of

    # -- the controller's questions ---------------------------------------------------------------
    def open(self, step: list[SearchPath], done: list[SearchPath], *, expands_next: bool, is_last_next: bool) -> None:
        """A step of `step`'s paths starts a group (and a step follows it): its paths may speculate once
        done, and so may the paths in `done`, whose step is done already (parked, nothing decoded
        past it)."""
        self.is_open = self.is_enabled
        self.expands_next, self.is_last_next = expands_next, is_last_next
        scores = [p.step_scores[-1] for p in step if p.step_scores]
        self.score_range = (min(scores), max(scores)) if scores else None
        for path in done:
            if not path.speculating and path.num_speculative == 0 and path not in self.branches \
                    and self.on_step_done(path, holds_slot=False):
                self.search.plan.resume(path.seq)

    def potential(self, path: SearchPath) -> int:
        """Its most branches: the bin of its last score among `beam_width` equal bins of the step's
        range of last scores (the highest: `beam_width`; all of them where the scores do not differ). The
        greedy anchor never has children: it decodes on as itself alone."""
        if not self.expands_next or path.uid == ANCHOR_UID:
            return 1
        if not path.step_scores or self.score_range is None or self.score_range[1] <= self.score_range[0]:
            return self.beam_width
        low, high = self.score_range
        return min(self.beam_width, 1 + int((path.step_scores[-1] - low) / (high - low) * self.beam_width))

    def on_step_done(self, path: SearchPath, holds_slot: bool = True) -> bool:
        """`path` ended its step without ending: whether it decodes on as branch 0 (in the slot it
        holds, or in an idle one)."""
        if not self._may_run(1, new_slots=0 if holds_slot else 1):
            return False
        path.speculating = True
        self.speculating.add(path)
        for ordinal in range(1, self.potential(path)):
            self.wants.append((-self.potential(path), ordinal, self.num_asked, path))
            self.num_asked += 1
        self._fill()
        return True

    def adopt(self, parent: SearchPath, ordinal: int) -> Branch | None:
        """The branch decoding `parent`'s `ordinal`-th new child, handed over (None: there is none)."""
        branch = self.branches.get(parent, {}).pop(ordinal, None)
        if branch is not None:
            self.tokens["adopted"] += branch.num_tokens
        return branch

    def release(self, parent: SearchPath) -> None:
        """`parent`'s branches no child took (all of them when it was pruned) are dropped."""
        self.wants = [w for w in self.wants if w[3] is not parent]
        for branch in self.branches.pop(parent, {}).values():
            self.tokens["discarded"] += branch.num_tokens
            self.running.discard(branch)
            self.search.plan.release(branch.seq)

    def stop(self) -> None:
        """The step's group is done: every speculative slot is given back, branches keep their
        tokens, parked, and none starts until the next group."""
        self.is_open = False
        self.pause()

    def pause(self) -> None:
        """Other work waits: every speculative slot is given back (branches keep their tokens,
        parked); paths ending their steps later may still speculate in slots idle by then."""
        self.wants = []
        for path in list(self.speculating):
            self._end_path(path)
        for branch in list(self.running):
            self._end_branch(branch)

    def group_done(self, last: SearchPath) -> None:
        """A group of the step is done, `last` its last path to finish: the head start that path had
        shortened the group by as many decode steps (at least: without it, it alone would have run that
        much longer). The step-cost model hears it with the speculative tokens decoded since it last
        heard (scheduler.step_cost), so `auto` learns within a search what speculation saves."""
        if self.num_decoded > self.num_reported or last.head_start:
            self.search.host.observe_speculation(last.head_start, self.num_decoded - self.num_reported)
            self.num_reported = self.num_decoded

    def sequences(self) -> list[Sequence]:
        return [b.seq for branches in self.branches.values() for b in branches.values()]

    # -- tokens -----------------------------------------------------------------------------------
    def on_path_token(self, path: SearchPath, out) -> None:
        """A token of branch 0, past `path.step_end`."""
        self.search.count_token()
        self.num_decoded += 1
        if out.logprob is not None:
            path.spec_logprobs.append(out.logprob)
        reason, ends_step = self.search.rules.outcome(path, out.token_id, path.step_end,
                                                        is_last_step=self.is_last_next)
        if reason is not None or ends_step:
            path.spec_outcome, path.spec_finish = "step", reason
            self._end_path(path)
            self._fill()
        elif not self._may_run():
            self._end_path(path)

    def on_branch_token(self, branch: Branch, out) -> None:
        self.search.count_token()
        self.num_decoded += 1
        if out.logprob is not None:
            branch.logprobs.append(out.logprob)
        reason, ends_step = self.search.rules.outcome(branch, out.token_id, branch.parent.step_end,
                                                        is_last_step=self.is_last_next)
        if reason is not None or ends_step:
            branch.outcome, branch.finish = "step", reason
            self._end_branch(branch)
            self._fill()
        elif not self._may_run():
            self._end_branch(branch)

    # -- slots ------------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return len(self.speculating) + len(self.running)

    def _may_run(self, more: int = 0, new_slots: int = 0) -> bool:
        """Whether `more` speculative rows may be added, `new_slots` of them in slots not yet held
        (none: whether the running ones may go on): the step's group is decoding, nothing else wants
        the slots, and the step-cost model says the rows pay."""
        host = self.search.host
        if not self.is_open or not host.has_idle_slot():
            return False
        if new_slots and host.num_idle_slots() < new_slots:
            return False
        cap = host.speculative_row_cap(self.num_rows)
        return cap is None or self.num_rows + more <= cap

    def _fill(self) -> None:
        """Start the wanted branches the idle slots allow, highest potential first."""
        self.wants.sort(key=lambda w: w[:3])
        started = 0
        while self.wants and self.is_open:
            host = self.search.host
            cap = host.speculative_row_cap(self.num_rows)
            if host.num_idle_slots() <= started or (cap is not None and self.num_rows >= cap):
                break
            _, ordinal, _, parent = self.wants.pop(0)
            self._start_branch(parent, ordinal)
            started += 1  # its fork runs once the engine carries the plan out

    def _start_branch(self, parent: SearchPath, ordinal: int) -> None:
        plan = self.search.plan
        seq = plan.fork(parent.seq, parent.step_end)
        branch = Branch(self, parent, ordinal, seq, self.search.child_sampling(parent, ordinal))
        seq.owner = branch
        self.branches.setdefault(parent, {})[ordinal] = branch
        self.running.add(branch)
        plan.resume(seq)

    def _end_path(self, path: SearchPath) -> None:
        path.speculating = False
        self.speculating.discard(path)
        self.search.plan.park(path.seq)

    def _end_branch(self, branch: Branch) -> None:
        self.running.discard(branch)
        self.search.plan.park(branch.seq)

    # -- LookAhead verification -------------------------------------------------------------------
    def lookahead_unit(self, path: SearchPath, granularity: int, rollouts: int, delimiter: str) -> str | None:
        """The path's next unit, if branch 0's tokens complete it and it will be scored alone
        (granularity 1, no roll-out look-ahead): a verifier may score it along with this one."""
        if path.spec_outcome is None or granularity != 1 or rollouts:
            return None
        tokenizer = self.search.host.tokenizer
        unit = normalize_step(tokenizer.decode(path.seq.token_ids[path.step_end:], skip_special_tokens=True), delimiter)
        return unit if unit.strip() else None
