"""Two methods on the same problems: is the difference in accuracy real, and how many problems would show it?

Pure arithmetic on per-problem outcomes (True = right), no model. For a method A and a baseline B asked the
same n problems, the 2 x 2 table of pairs is

                    B right   B wrong
        A right        a         b
        A wrong        c         d

and only the discordant pairs b and c carry information about which is better:

- `mcnemar_exact(b, c)`: the exact (binomial) McNemar test. Under "A and B are equally good" each discordant
  pair is A's with probability 1/2, so p = min(1, 2 * sum_{k <= min(b, c)} C(b + c, k) / 2^(b + c)).
- `newcombe_interval(a, b, c, d)`: a 95 % interval for acc(A) - acc(B) = (b - c) / n, Newcombe's (1998)
  method 10: the Wilson intervals of the two accuracies combined with the correlation of the pairs. Unlike
  the Wald interval it stays inside [-1, 1] and does not shrink to a point when b or c is 0, which is
  what a small benchmark produces.
- `problems_needed(...)`: Connor's (1987) sample size for McNemar's test; `problems_needed_exact(...)`: the
  smallest n at which the exact test above reaches the power (it is conservative, so a little more).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from statistics import NormalDist

from bench.problems import levels_in_band

ALPHA = 0.05


def z_two_sided(alpha: float = ALPHA) -> float:
    """The normal quantile of a two-sided test at `alpha` (1.95996... at 0.05)."""
    return NormalDist().inv_cdf(1 - alpha / 2)


def mcnemar_exact(b: int, c: int) -> float:
    """The two-sided exact McNemar p-value of b and c discordant pairs (1.0 when there are none)."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got {b} and {c}")
    total = b + c
    tail = sum(math.comb(total, k) for k in range(min(b, c) + 1))
    return float(min(Fraction(1), Fraction(2 * tail, 2**total)))


def wilson(correct: int, total: int, z: float) -> tuple[float, float]:
    """The Wilson score interval of a proportion ((0, 1) when there is nothing to count)."""
    if total == 0:
        return 0.0, 1.0
    p = correct / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe_interval(a: int, b: int, c: int, d: int, alpha: float = ALPHA) -> tuple[float, float]:
    """Newcombe's (1998, method 10) interval for (b - c) / n, the paired difference in accuracy.

    With p1 = (a + b) / n in (l1, u1) and p2 = (a + c) / n in (l2, u2) (Wilson) and the phi correlation
    phi = e / sqrt((a + b)(c + d)(a + c)(b + d)) (0 when a margin is empty), where e = ad - bc, except
    that a positive ad - bc is continuity-corrected to max(0, ad - bc - n / 2):
    lower = (p1 - p2) - sqrt((p1 - l1)^2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)^2),
    upper = (p1 - p2) + sqrt((u1 - p1)^2 - 2 phi (u1 - p1)(p2 - l2) + (p2 - l2)^2).
    """
    n = a + b + c + d
    if n == 0:
        return -1.0, 1.0
    z = z_two_sided(alpha)
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson(a + b, n, z)
    l2, u2 = wilson(a + c, n, z)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    # Newcombe's continuity correction of phi: a positive ad - bc shrinks by n / 2 (not below 0).
    excess = a * d - b * c
    excess = max(0.0, excess - n / 2) if excess > 0 else excess
    phi = excess / math.sqrt(margins) if margins else 0.0
    lower = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    upper = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return max(-1.0, p1 - p2 - lower), min(1.0, p1 - p2 + upper)


@dataclass(frozen=True)
class Paired:
    """A method against a baseline on the same problems: the four cells of the table above."""

    both: int  # a: both right
    only_method: int  # b: the method right, the baseline wrong
    only_baseline: int  # c: the method wrong, the baseline right
    neither: int  # d

    @classmethod
    def of(cls, method: Sequence[bool], baseline: Sequence[bool]) -> Paired:
        if len(method) != len(baseline):
            raise ValueError(f"paired outcomes must cover the same problems: {len(method)} and {len(baseline)}")
        pairs = list(zip(method, baseline))
        return cls(pairs.count((True, True)), pairs.count((True, False)), pairs.count((False, True)),
                   pairs.count((False, False)))

    @property
    def problems(self) -> int:
        return self.both + self.only_method + self.only_baseline + self.neither

    @property
    def difference(self) -> float:
        """acc(method) - acc(baseline)."""
        return (self.only_method - self.only_baseline) / self.problems if self.problems else 0.0

    @property
    def p_value(self) -> float:
        return mcnemar_exact(self.only_method, self.only_baseline)

    def interval(self, alpha: float = ALPHA) -> tuple[float, float]:
        return newcombe_interval(self.both, self.only_method, self.only_baseline, self.neither, alpha)

    def verdict(self, alpha: float = ALPHA) -> str:
        if self.p_value >= alpha:
            return "not significant"
        return "significantly better" if self.difference > 0 else "significantly worse"

    def as_dict(self, alpha: float = ALPHA) -> dict:
        low, high = self.interval(alpha)
        return {"difference": round(self.difference, 4), "ci95": [round(low, 4), round(high, 4)],
                "p_value": round(self.p_value, 4), "discordant": [self.only_method, self.only_baseline],
                "verdict": self.verdict(alpha)}


def sentence(label: str, baseline: str, paired: Paired, alpha: float = ALPHA) -> str:
    """`best_of_n:confidence N=8 vs greedy: -6.7 points [-12.1, -1.3], p = 0.03, significantly worse`."""
    low, high = paired.interval(alpha)
    return (f"{label} vs {baseline}: {100 * paired.difference:+.1f} points [{100 * low:+.1f}, {100 * high:+.1f}], "
            f"{p_clause(paired.p_value)}, {paired.verdict(alpha)}")


def format_p(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}" if p < 0.01 else f"{p:.2f}"


def p_clause(p: float) -> str:
    """`p = 0.03`, `p = 0.008`, `p < 0.001`."""
    return "p < 0.001" if p < 0.001 else f"p = {format_p(p)}"


# ---------------------------------------------------------------------------------------------
# power: how many problems a comparison needs


def problems_needed(difference: float = 0.10, discordance: float = 0.20, alpha: float = ALPHA,
                    power: float = 0.80) -> int:
    """Connor's (1987) number of pairs for McNemar's test to detect `difference` = p_b - p_c (the two
    discordant rates) when `discordance` = p_b + p_c of the pairs disagree:
    n = (z_{1-alpha/2} sqrt(psi) + z_{power} sqrt(psi - delta^2))^2 / delta^2, rounded up."""
    _check_rates(difference, discordance)
    z_alpha, z_beta = z_two_sided(alpha), NormalDist().inv_cdf(power)
    psi, delta = discordance, abs(difference)
    return math.ceil((z_alpha * math.sqrt(psi) + z_beta * math.sqrt(psi - delta * delta)) ** 2 / (delta * delta))


def exact_power(problems: int, difference: float = 0.10, discordance: float = 0.20, alpha: float = ALPHA) -> float:
    """The power of `mcnemar_exact` at `alpha` on `problems` pairs: the number of discordant pairs D is
    binomial(n, psi), and given D the method's share is binomial(D, (psi + delta) / (2 psi))."""
    _check_rates(difference, discordance)
    return sum(_binomial_pmf(problems, discordance, total) * _reject_given(total, difference, discordance, alpha)
               for total in range(problems + 1))


def problems_needed_exact(difference: float = 0.10, discordance: float = 0.20, alpha: float = ALPHA,
                          power: float = 0.80, limit: int = 5000) -> int:
    """The smallest n from which the exact test's power stays at or above `power` (the power of an exact
    test saws up and down with n, so the first n above it is not enough: every n after it must be too;
    checked up to 25 % beyond the first)."""
    n = problems_needed(difference, discordance, alpha, power)
    while n > 1 and exact_power(n - 1, difference, discordance, alpha) >= power:
        n -= 1
    while n <= limit:
        if exact_power(n, difference, discordance, alpha) >= power:
            ahead = range(n + 1, n + 1 + max(10, n // 4))
            failing = [m for m in ahead if exact_power(m, difference, discordance, alpha) < power]
            if not failing:
                return n
            n = failing[-1] + 1
        else:
            n += 1
    raise ValueError(f"more than {limit} problems needed")


def power_table(discordances: Sequence[float] = (0.15, 0.20, 0.25, 0.30), difference: float = 0.10,
                alpha: float = ALPHA, power: float = 0.80) -> list[dict]:
    """Problems needed per assumed discordance rate, by Connor's formula and for the exact test."""
    rows = []
    for psi in discordances:
        connor = problems_needed(difference, psi, alpha, power)
        rows.append({"discordance": psi, "difference": difference, "alpha": alpha, "power": power,
                     "connor": connor, "exact_power_at_connor": round(exact_power(connor, difference, psi, alpha), 3),
                     "exact": problems_needed_exact(difference, psi, alpha, power)})
    return rows


def _check_rates(difference: float, discordance: float) -> None:
    if not 0 < abs(difference) < discordance <= 1:
        raise ValueError(f"need 0 < |difference| < discordance <= 1, got {difference} and {discordance}")


def _binomial_pmf(n: int, p: float, k: int) -> float:
    if p in (0.0, 1.0):
        return float(k == round(n * p))
    log = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)
    return math.exp(log)


@functools.lru_cache(maxsize=None)
def _reject_given(total: int, difference: float, discordance: float, alpha: float) -> float:
    """P(the exact test rejects | `total` discordant pairs)."""
    critical = _critical(total, alpha)
    if critical < 0:
        return 0.0
    share = (discordance + difference) / (2 * discordance)
    low = sum(_binomial_pmf(total, share, k) for k in range(critical + 1))
    high = sum(_binomial_pmf(total, share, k) for k in range(total - critical, total + 1))
    return low + high


_CRITICAL: dict[tuple[int, float], int] = {}


def _critical(total: int, alpha: float) -> int:
    """The largest min(b, c) the exact test rejects at `alpha` with `total` discordant pairs (-1: none)."""
    key = (total, alpha)
    if key not in _CRITICAL:
        k = -1
        while k + 1 <= total // 2 and mcnemar_exact(k + 1, total - k - 1) < alpha:
            k += 1
        _CRITICAL[key] = k
    return _CRITICAL[key]


# ---------------------------------------------------------------------------------------------
# a benchmark's rows compared


def comparisons(rows: Sequence[dict], alpha: float = ALPHA) -> list[dict]:
    """Every row of a benchmark (`label`, `method`, `n`, `tokens_generated` per problem, `statuses` per
    problem, `correct` meaning right) against greedy decoding and against majority voting at equal
    generated tokens, on the same problems.

    Equal tokens: majority voting runs at the same list of N as the other methods, and a row's baseline is
    the majority row whose generated tokens per problem are nearest on a log scale (a tie goes to the larger
    N). Best-of-N samples the same kind of whole answers as voting, so at equal N its tokens match within a
    few percent; beam search and DVTS spend more (refilled beams, per-step caps), so their match is the
    nearest N, and `token_ratio` (the row's tokens over the baseline's) says how close it is. The baseline
    is the engine's own majority answer at that N, what a user asking for it gets, not votes subsampled after
    the fact. Greedy is compared with nothing; majority rows only with greedy.
    """
    greedy = next((r for r in rows if r["method"] == "greedy"), None)
    majority = [r for r in rows if r["method"] == "majority"]
    out = []
    for row in rows:
        if row["method"] == "greedy":
            continue
        entry: dict = {"label": row["label"], "n": row["n"]}
        if greedy is not None:
            entry["vs_greedy"] = {"baseline": "greedy", **_paired(row, greedy).as_dict(alpha)}
        if row["method"] != "majority" and majority:
            match = nearest_in_tokens(row, majority)
            entry["vs_majority"] = {"baseline": f"majority N={match['n']}", "baseline_n": match["n"],
                                    "token_ratio": round(_tokens(row) / _tokens(match), 2),
                                    **_paired(row, match).as_dict(alpha)}
        out.append(entry)
    return out


def nearest_in_tokens(row: dict, candidates: Sequence[dict]) -> dict:
    """The candidate whose generated tokens per problem are nearest the row's (log scale; ties: larger N)."""
    return min(candidates, key=lambda c: (abs(math.log(_tokens(c) / _tokens(row))), -c["n"]))


def comparison_lines(compared: Sequence[dict], alpha: float = ALPHA) -> list[str]:
    """The comparisons as a table, then in words which differences are significant at `alpha`."""
    lines = [f"paired against greedy and against majority voting at the nearest generated tokens (same problems; "
             f"difference in points with Newcombe's 95 % interval, exact McNemar p):",
             f"{'method':<28} {'vs greedy':>26} {'p':>7}   {'vs majority':<13} {'tok x':>5} {'difference':>26} "
             f"{'p':>7}"]
    significant = []
    for entry in compared:
        name = f"{entry['label']} N={entry['n']}"
        cells = []
        for key in ("vs_greedy", "vs_majority"):
            cmp = entry.get(key)
            if cmp is None:
                cells.append(f"{'-':>26} {'':>7}" if key == "vs_greedy" else f"{'-':<13} {'':>5} {'-':>26} {'':>7}")
                continue
            text = f"{_points(cmp['difference'])} [{_points(cmp['ci95'][0])}, {_points(cmp['ci95'][1])}]"
            cell = f"{text:>26} {format_p(cmp['p_value']):>7}"
            cells.append(cell if key == "vs_greedy" else f"{cmp['baseline']:<13} {cmp['token_ratio']:>5.2f} {cell}")
            if cmp["p_value"] < alpha:
                significant.append(f"{name} vs {cmp['baseline']}: {text.replace('[', 'points [', 1)}, "
                                   f"{p_clause(cmp['p_value'])}, {cmp['verdict']}")
        lines.append(f"{name:<28} {cells[0]}   {cells[1]}".rstrip())
    if significant:
        lines += [f"significant at {alpha}:"] + [f"  {line}" for line in significant]
    else:
        lines.append(f"no difference is significant at {alpha}")
    return lines


def power_lines(table: Sequence[dict]) -> list[str]:
    """`power_table` as text."""
    first = table[0]
    lines = [f"problems needed to detect a {100 * first['difference']:.0f}-point paired difference at "
             f"{100 * first['power']:.0f} % power, alpha {first['alpha']} two-sided (McNemar):",
             f"{'discordance':>11} {'Connor 1987':>12} {'exact-test power there':>23} {'exact test':>11}"]
    for row in table:
        lines.append(f"{100 * row['discordance']:>10.0f}% {row['connor']:>12} {row['exact_power_at_connor']:>23.3f} "
                     f"{row['exact']:>11}")
    lines.append("discordance: the share of problems on which the two methods disagree (one right, one wrong)")
    return lines


def pilot_advice(results: dict, low: float = 0.2, high: float = 0.7, difference: float = 0.10,
                 alpha: float = ALPHA, power: float = 0.80) -> dict:
    """What a pilot run (an accuracy benchmark's JSON with a greedy row) says about the powered run: the
    levels where greedy is right on `low`-`high` of the problems, and per compared row the observed
    discordance with greedy and the problems a `difference`-point effect at that discordance needs."""
    greedy = next((r for r in results["results"] if r["method"] == "greedy"), None)
    if greedy is None:
        raise ValueError("the pilot has no greedy row; run it with --methods greedy,...")
    band = levels_in_band(greedy["by_level"], low, high)
    rows = []
    for entry in results.get("comparisons", []):
        cmp = entry.get("vs_greedy")
        if cmp is None:
            continue
        problems = len(greedy["statuses"])
        discordance = sum(cmp["discordant"]) / problems if problems else 0.0
        needed = (problems_needed(difference, discordance, alpha, power)
                  if difference < discordance else None)
        rows.append({"label": entry["label"], "n": entry["n"], "discordance": round(discordance, 3),
                     "problems_needed": needed})
    return {"greedy_by_level": greedy["by_level"], "band": [low, high], "levels_in_band": band, "rows": rows}


def _paired(row: dict, baseline: dict) -> Paired:
    return Paired.of([s == "correct" for s in row["statuses"]], [s == "correct" for s in baseline["statuses"]])


def _tokens(row: dict) -> float:
    return max(float(row["tokens_generated"]), 1.0)


def _points(fraction: float) -> str:
    return f"{100 * fraction:+.1f}"
