"""Decoding past the step: speculative beam extension and look-ahead verification.

Speculative beam extension (FlashTTS): a path done with its step while others of its group still
decode keeps decoding into its next step in the idle slot, until that step ends, the group is done
or the slot is wanted. Verification never sees those tokens (`step_end` marks where the step
ended). A path that survives settling keeps them: they are exactly what it would decode next, from
the same KV and the same sampler, so its next step starts ahead, or is already complete. Its
children fork at `step_end`; a pruned path's speculative tokens are dropped.

LookAhead verification: a reward model scoring a path whose speculative tokens complete its next
step scores both steps in one sequence (the current step's score is read where it always is, so it
cannot see the next step); if the path goes on to that very step, its score is already known.
"""

from __future__ import annotations

import msgspec

from runtime.model.sampler import SamplingState
from runtime.search.aggregate import normalize_step
from runtime.search.paths import Lookahead, SearchPath


class DecodingAhead:
    """The part of `SearchController` that decodes past a path's step; it shares the controller's state."""

    # -- speculative beam extension ---------------------------------------------------------------
    def _may_speculate(self) -> bool:
        return (self.host.config.speculative_extension and bool(self.active)
                and self.step_index < self.search.max_steps - 1 and self.host.has_idle_slot())

    def _on_speculative_token(self, path: SearchPath, out) -> None:
        self.stats["tokens_generated"] += 1
        if out.logprob is not None:
            path.spec_logprobs.append(out.logprob)
        reason, ends_step, _ = self._step_outcome(path, out.token_id, path.step_end,
                                                  is_last_step=self.step_index + 1 >= self.search.max_steps - 1)
        if reason is not None or ends_step:
            path.spec_outcome, path.spec_finish = "step", reason
            self._end_speculation(path)
        elif not self.active or not self.host.has_idle_slot():
            self._end_speculation(path)

    def _end_speculation(self, path: SearchPath) -> None:
        path.speculating = False
        self.speculating.discard(path)
        self.plan.park(path.seq)

    def stop_speculation(self) -> None:
        """Give every idle slot back (the scheduler has other work, or the group is done)."""
        for path in list(self.speculating):
            self._end_speculation(path)

    # -- look-ahead -----------------------------------------------------------------------------
    def _start_lookahead(self, path: SearchPath) -> None:
        seq = self.plan.fork(path.seq, path.step_end)
        greedy = msgspec.structs.replace(self.params, temperature=0.0)
        sampling = SamplingState(greedy, 0, self.host.device, track_logprobs=True)
        if path.sampling.constraint is not None:  # the look-ahead keeps to the grammar from the step's end
            sampling.constraint = path.sampling.constraint.fork(path.step_end - len(self.prompt_ids))
        run = Lookahead(path, seq, sampling, len(seq.token_ids), self.search.lookahead, len(seq.token_ids))
        seq.owner = run
        self.lookaheads.add(run)
        self.plan.resume(seq)

    def on_lookahead_token(self, run: Lookahead, out) -> None:
        seq, path = run.seq, run.path
        self.stats["tokens_generated"] += 1
        if out.logprob is not None:
            path.lookahead_logprobs.append(out.logprob)
        reason, ends_step, _ = self._step_outcome(run, out.token_id, run.step_start, is_last_step=False)
        ends = reason is not None
        if ends_step:
            run.steps_left -= 1
            run.step_start = len(seq.token_ids)
            ends = run.steps_left == 0
        if not ends:
            return
        text = self.host.tokenizer.decode(seq.token_ids[run.start:], skip_special_tokens=True)
        units = [normalize_step(u, self.search.step_delimiter) for u in text.split(self.search.step_delimiter)]
        path.lookahead_units = [u for u in units if u.strip()]
        self.plan.release(seq)
        self.lookaheads.discard(run)
        if not self.lookaheads:
            self._submit_scores()

    def lookahead_unit(self, path: SearchPath) -> str | None:
        """The path's next unit, if its speculative tokens complete it and it will be scored alone
        (granularity 1, no roll-out look-ahead): a verifier may score it along with this one."""
        if path.spec_outcome is None or self.search.granularity != 1 or self.search.lookahead:
            return None
        unit = self.host.tokenizer.decode(path.seq.token_ids[path.step_end:], skip_special_tokens=True)
        unit = normalize_step(unit, self.search.step_delimiter)
        return unit if unit.strip() else None

    def on_next_score(self, path: SearchPath, unit: str, score: float) -> None:
        path.next_score = (unit, float(score))
