"""Model-independent arithmetic of the search: aggregating a path's step scores, sharing a width among
survivors (dynamic branching), refilling a beam set, and cleaning step texts before they are scored.

Pure Python on purpose: the strategies call these once per step on at most a few hundred floats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

AGGREGATIONS = ("last", "min", "prod", "mean")

# Keeps every survivor's weight positive, so the lowest-scored survivor is not silently zeroed by
# the shift and a set of equal scores splits the width evenly (the reference's constant).
BRANCH_WEIGHT_FLOOR = 1e-6


def aggregate(step_scores: Sequence[float], mode: str) -> float:
    """One score for a path from its per-step verifier scores."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; expected one of {', '.join(AGGREGATIONS)}")
    if not step_scores:
        raise ValueError("cannot aggregate a path with no step scores")
    if mode == "last":
        return float(step_scores[-1])
    if mode == "min":
        return float(min(step_scores))
    if mode == "prod":
        return float(math.prod(step_scores))
    return float(math.fsum(step_scores) / len(step_scores))


def allocate_children(scores: Sequence[float], n: int) -> list[int]:
    """Children per survivor, proportional to its aggregated score; the counts sum to exactly `n`.

    `w_i = score_i - min(scores) + 1e-6`, `count_i = floor(n * w_i / sum(w))`, and the leftover
    `n - sum(count)` goes one each to the largest fractional parts `n * w_i / sum(w) - count_i`,
    ties to the lower index. A survivor may get 0 children (it is pruned).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not scores:
        if n:
            raise ValueError("cannot allocate children among no survivors")
        return []
    if any(math.isnan(s) or math.isinf(s) for s in scores):
        raise ValueError(f"scores must be finite, got {list(scores)}")
    lowest = min(scores)
    weights = [s - lowest + BRANCH_WEIGHT_FLOOR for s in scores]
    total = math.fsum(weights)
    shares = [n * w / total for w in weights]
    counts = [math.floor(share) for share in shares]
    leftover = n - sum(counts)
    # Rounding can only make sum(shares) differ from n by far less than 1, so 0 <= leftover < len.
    by_fraction = sorted(range(len(scores)), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in by_fraction[:max(leftover, 0)]:
        counts[i] += 1
    assert sum(counts) == n, (counts, n)
    return counts


def refill(survivors: Sequence[T], n: int) -> list[T]:
    """`n` entries made by repeating the survivors cyclically: s0, s1, ..., s_{k-1}, s0, s1, ...

    With more than `n` survivors the first `n` are kept (the reference's `(beams * repeats)[:n]`).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not survivors:
        if n:
            raise ValueError("cannot refill from no survivors")
        return []
    return [survivors[i % len(survivors)] for i in range(n)]


def normalize_step(text: str, delimiter: str) -> str:
    """The step text without its trailing delimiter, so a verifier never sees (and scores) an empty
    step after it. Repeated trailing delimiters all go; with a whitespace delimiter such as "\\n\\n"
    any trailing whitespace goes too."""
    if not delimiter:
        return text
    while text.endswith(delimiter):
        text = text[: -len(delimiter)]
    if not delimiter.strip():
        text = text.rstrip()
    return text


def split_steps(text: str, delimiter: str) -> list[str]:
    """A finished answer cut into steps at the delimiter (for scoring a best-of-N answer with a PRM),
    each normalised; empty pieces (a trailing or doubled delimiter) are dropped."""
    if not delimiter:
        return [text] if text.strip() else []
    pieces = (normalize_step(piece, delimiter) for piece in text.split(delimiter))
    return [piece for piece in pieces if piece.strip()]
