"""What a decode step costs, measured, and how many speculative rows that makes worth adding to one.

A decode step (every row one token) takes `fixed + per_row x rows` seconds: the fixed part reads the
weights and pays the step's overheads once, the per-row part is each row's compute. The model is a
least-squares fit over the engine's recent decode steps (older steps weigh less, by `DECAY` a step).
A GPU's steps cost nearly the same at 6 rows as at 16 (per_row near 0); a CPU's grow with every row.

Speculative beam extension (runtime.search.speculation) adds rows while a step's stragglers finish.
A row pays if what it saves is worth more than what it costs: a speculative row costs `per_row` in
every step it runs in, and a decode step it saves costs `fixed + per_row x rows`. A speculative token
saves a decode step only where it shortens a search step, which lasts as long as its last path: the
head start that path had when the step began is steps saved (at least: without it, that path alone
would have taken as much longer). Kept tokens of paths that finish early save nothing. So `useful` is
the steps saved per speculative token decoded (measured per search), and a step may hold up to
    useful x (fixed / per_row + rows)
speculative rows beside its `rows` other ones. Until the fit has steps of two batch sizes, no rows
are added (a guess could only make the search slower than without them).
"""

from __future__ import annotations

import math

DECAY = 0.98  # weight a step's observation loses with each newer one
PRIOR_USEFUL = 0.5  # decode steps saved per speculative token before any were measured
MIN_WEIGHT = 4.0  # observations (decayed) needed before the fit decides anything


class StepCost:
    def __init__(self) -> None:
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.saved = 0
        self.speculated = 0

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step of `rows` rows took `seconds`."""
        if rows <= 0 or not seconds > 0:
            return
        d = DECAY
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + rows, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + rows * rows, d * self.sxy + rows * seconds

    def observe_speculation(self, saved: int, speculated: int) -> None:
        """A search decoded `speculated` speculative tokens, which saved it `saved` decode steps."""
        self.saved += saved
        self.speculated += speculated

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds a row), or None until decode steps of two batch sizes were seen."""
        if self.n < MIN_WEIGHT:
            return None
        spread = self.n * self.sxx - self.sx * self.sx
        if spread <= 1e-9 * self.n * self.sxx:
            return None
        per_row = (self.n * self.sxy - self.sx * self.sy) / spread
        fixed = (self.sy - per_row * self.sx) / self.n
        return max(fixed, 0.0), max(per_row, 0.0)

    @property
    def useful(self) -> float:
        return self.saved / self.speculated if self.speculated else PRIOR_USEFUL

    def speculative_rows(self, other_rows: int) -> int | None:
        """The most speculative rows that pay beside `other_rows` rows (None: no bound, rows are free)."""
        fitted = self.fit()
        if fitted is None:
            return 0
        fixed, per_row = fitted
        if per_row <= 0.0:
            return None
        return max(0, math.floor(self.useful * (fixed / per_row + other_rows) + 1e-9))  # (a fit is rounded)

    def describe(self) -> str:
        fitted = self.fit()
        if fitted is None:
            return "not measured yet: no speculative rows"
        fixed, per_row = fitted
        cap = self.speculative_rows(16)
        rows = "any number of" if cap is None else f"up to {cap}"
        return (f"{fixed * 1e3:.1f} ms a step + {per_row * 1e3:.2f} ms a row, {self.useful:.0%} of speculative "
                f"tokens saved a step: {rows} speculative rows beside 16")
