"""Roll-out look-ahead (`search.lookahead` = k): before a step is scored, each path's throwaway greedy
fork decodes k more steps, and the verifier scores the step with them; the forks are then released.
And the unit a verifier may score along with the step, where speculation decoded it ahead
(`lookahead_unit`). Speculative decoding past a step is `runtime.search.speculation`."""

from __future__ import annotations

from typing import Callable, Protocol

import msgspec

from runtime.model.sampler import SamplingState
from runtime.search.aggregate import normalize_step
from runtime.search.host import SearchHost
from runtime.search.paths import Lookahead, SearchPath, StepAhead
from runtime.search.plan import SearchPlan
from runtime.search.steps import StepRules
from runtime.wire.params import SamplingParams, SearchParams
from scheduler.sequence import Sequence


def lookahead_unit(path: SearchPath, ahead: list[StepAhead], search: SearchParams, tokenizer) -> str | None:
    """LookAhead verification (FlashTTS section 4.1.3): the path's next unit, if its first step decoded
    ahead (`ahead`, speculation's) is complete and it will be scored alone (granularity 1, no roll-out
    look-ahead): a verifier may score it along with this one."""
    if not ahead or ahead[0].end is None or search.granularity != 1 or search.lookahead:
        return None
    ids = path.seq.token_ids[path.step_end:ahead[0].end]
    unit = normalize_step(tokenizer.decode(ids, skip_special_tokens=True), search.step_delimiter)
    return unit if unit.strip() else None


class RolloutPort(Protocol):
    """What roll-outs read of their search (`runtime.search.controller.SearchController`)."""

    host: SearchHost
    plan: SearchPlan
    params: SamplingParams
    search: SearchParams
    prompt_ids: list[int]

    rules: StepRules

    def count_token(self) -> None: ...


class Rollouts:
    """The look-ahead forks of the step being verified; `done` runs once the last has ended."""

    def __init__(self, search: RolloutPort, done: Callable[[], None]) -> None:
        self.search = search
        self.done = done
        self.runs: set[Lookahead] = set()

    def start(self, paths: list[SearchPath]) -> None:
        search = self.search
        self.runs = set()
        for path in paths:
            seq = search.plan.fork(path.seq, path.step_end)
            greedy = msgspec.structs.replace(search.params, temperature=0.0)
            constraint = path.sampling.constraint  # the look-ahead keeps to the grammar from the step's end
            sampling = SamplingState(greedy, 0, search.host.device, track_logprobs=True,
                                     constraint=None if constraint is None else
                                     constraint.fork(path.step_end - len(search.prompt_ids)))
            run = Lookahead(path, seq, sampling, len(seq.token_ids), search.search.lookahead, len(seq.token_ids))
            seq.own(run)
            self.runs.add(run)
            search.plan.resume(seq)

    def on_token(self, run: Lookahead, out) -> None:
        search = self.search
        seq, path = run.seq, run.path
        search.count_token()
        if out.logprob is not None:
            path.lookahead_logprobs.append(out.logprob)
        reason, ends_step = search.rules.outcome(run, out.token_id, run.step_start, is_last_step=False)
        ends = reason is not None
        if ends_step:
            run.steps_left -= 1
            run.step_start = len(seq.token_ids)
            ends = run.steps_left == 0
        if not ends:
            return
        delimiter = search.search.step_delimiter
        text = search.host.tokenizer.decode(seq.token_ids[run.start:], skip_special_tokens=True)
        units = [normalize_step(u, delimiter) for u in text.split(delimiter)]
        path.lookahead_units = [u for u in units if u.strip()]
        search.plan.release(seq)
        self.runs.discard(run)
        if not self.runs:
            self.done()

    def sequences(self) -> list[Sequence]:
        return [run.seq for run in self.runs]
