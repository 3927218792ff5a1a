"""A search's time budget (`search.timeout_s`): whether it has run out, and what became of the step it
cut short.

Past the deadline every running step ends at its next token and the search finishes, choosing among
the paths it has (live ones count as cut short). The step cut short is verified only by a free
verifier (`confidence`); with a model the answer is chosen by the scores of the last step verified in
full, so no verifier runs past the deadline: a model's verification still running then is abandoned
(`SearchController.check_deadline`), and the search answers at once. The pacer
(`runtime.search.pacing`) keeps steps short enough for the budget.
"""

from __future__ import annotations

import time


class Deadline:
    def __init__(self, timeout_s: float | None) -> None:
        self.at = time.monotonic() + timeout_s if timeout_s is not None else None
        self.timed_out = False  # once passed, passed for good (the clock is read until then)
        self.cut_step_verified: bool | None = None  # with `timed_out`: whether the step cut short was verified

    def passed(self) -> bool:
        """Whether the search is out of time."""
        if not self.timed_out and self.at is not None and time.monotonic() >= self.at:
            self.timed_out = True
        return self.timed_out

    def cut_step(self, verified: bool) -> None:
        """The step the deadline cut short is verified (a free verifier's scores) or not (a model's,
        not run or abandoned)."""
        self.cut_step_verified = verified

    def step_settled(self) -> None:
        """A step settled: if the deadline passed while its scores came in, that step was verified in full."""
        if self.passed() and self.cut_step_verified is None:
            self.cut_step_verified = True
