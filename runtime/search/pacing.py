"""Steps short enough for a search's time budget.

A search with `timeout_s` = T promises its answer within T x 1.1 + 0.5 s. Past the deadline the step
under way still has to end (a model verification is abandoned only between steps), so while such a
search is live no step may take longer than half that slack, 0.05 T + 0.25 s: the pacer caps the
tokens a step holds at what the engine's measured rate computes in that time. Smaller steps
change no result (a prompt prefilled in chunks gives the bits of one chunk where the engine is batch
invariant), only how the work is cut; a search of the server's default 600 s budget is never capped
in practice.
"""

from __future__ import annotations

from collections.abc import Iterable

# Steps of fewer tokens are mostly their fixed cost. Decode steps of a search's paths count: their
# cost a token is at least a prefill's, so a rate read from them errs towards shorter steps.
MEASURED_TOKENS = 8
SMOOTHING = 0.3  # weight of the newest step in the rate


class StepPacer:
    def __init__(self, smallest_step: int) -> None:
        self.smallest_step = smallest_step  # never cap below this many tokens (a block)
        self.seconds_per_token: float | None = None  # smoothed over recent steps

    def observe(self, tokens: int, seconds: float) -> None:
        """A model step of `tokens` tokens took `seconds`."""
        if tokens < MEASURED_TOKENS or seconds <= 0:
            return
        rate = seconds / tokens
        old = self.seconds_per_token
        self.seconds_per_token = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate

    def token_cap(self, searches: Iterable) -> int | None:
        """The most tokens the next step may hold, for the live `searches` (runtime.search.controller)
        with a deadline; None: no cap (no such search, or no rate measured yet). The engine gives it to
        its scheduler and to every reward model's store."""
        budget = min((s.search.timeout_s for s in searches if s.search.timeout_s is not None and not s.is_finished),
                     default=None)
        if budget is None or self.seconds_per_token is None:
            return None
        return max(self.smallest_step, int((0.05 * budget + 0.25) / self.seconds_per_token))
