"""What a decode step costs, measured, and whether speculative rows are worth adding to one.

A decode step (every row one token) takes `fixed + per_row x rows` seconds: the fixed part reads the
weights and pays the step's overheads once, the per-row part is each row's compute. The model is a
least-squares fit over the engine's recent decode steps (older steps weigh less, by `DECAY` a step).
A GPU's steps cost nearly the same at 6 rows as at 16 (per_row near 0); a CPU's grow with every row.

Speculative beam extension (runtime.search.speculation) adds rows while a step's stragglers finish.
They pay if what they save is worth more than what they cost: a speculative token costs `per_row`
(its row in one step), and a decode step it saves is worth `fixed + per_row x rows`. A speculative
token saves a decode step only where it shortens a search step, which lasts as long as its last path:
the head start that path had when the step began is steps saved (at least: without it, that path
alone would have taken as much longer). Kept tokens of paths that finish early save nothing. So
`useful` is the steps saved per speculative token decoded, and speculation pays while

    useful x (fixed / per_row + rows) >= 1

Then every idle slot may take a speculative row (the speculation ranks what it decodes, likeliest
first); else none. `useful` is measured per step group over every search the engine ran, starting
from `PRIOR_USEFUL` as if `PRIOR_TOKENS` speculative tokens had been measured at it: a search's first
groups save nothing (the steps their tokens save come in later groups, where children adopt them),
so the measurement alone would decline after the first group wherever it runs. The prior is what the
search example measured with speculation always on (0.010-0.023 steps a token, 12,800-21,400 tokens a
search, on a CPU and on an H200). On a CPU, where a row costs a sixth of a step's fixed part or more,
that declines from the first step, so `auto` costs nothing there; on a GPU, where a row costs under a
hundredth of it, it speculates from the first step on. Until the fit has steps of two batch sizes, no
rows are added (a guess could only make the search slower than without them).
"""

from __future__ import annotations


DECAY = 0.98  # weight a step's observation loses with each newer one
PRIOR_USEFUL = 0.02  # decode steps saved per speculative token before any were measured (module docstring)
PRIOR_TOKENS = 20_000  # as many speculative tokens as the prior weighs (about one search's)
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
        return (self.saved + PRIOR_USEFUL * PRIOR_TOKENS) / (self.speculated + PRIOR_TOKENS)

    def pays(self, other_rows: int) -> bool | None:
        """Whether speculative rows pay beside `other_rows` rows; None until the fit can tell."""
        fitted = self.fit()
        if fitted is None:
            return None
        fixed, per_row = fitted
        return per_row <= 0.0 or self.useful * (fixed / per_row + other_rows) >= 1.0 - 1e-9  # (a fit is rounded)

    def speculative_rows(self, other_rows: int) -> int | None:
        """The most speculative rows a step beside `other_rows` rows may hold: None (as many as are
        idle) where they pay, else 0."""
        return None if self.pays(other_rows) else 0

    def describe(self) -> str:
        fitted = self.fit()
        if fitted is None:
            return "not measured yet: no speculative rows"
        fixed, per_row = fitted
        verdict = "speculative rows pay" if self.pays(16) else "speculative rows do not pay"
        return (f"{fixed * 1e3:.1f} ms a step + {per_row * 1e3:.2f} ms a row, {self.useful:.3f} decode steps saved "
                f"a speculative token: {verdict} beside 16 rows")
