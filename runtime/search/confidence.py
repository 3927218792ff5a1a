"""DeepConf's measures of a trace (Fu et al. 2025, "Deep Think with Confidence"): token confidence,
group confidence over a sliding window of tokens, and the lowest group confidence of a trace.

A token's confidence is the negative mean log-probability of the model's `k` most likely tokens at its
position (the sampler reports it: `SampleOutput.confidence`); a peaked distribution gives a high one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence


class TraceConfidence:
    """The confidences of one trace's tokens, seen one at a time."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.recent: deque[float] = deque()  # the last `window` token confidences
        self.total = 0.0  # their sum
        self.num_tokens = 0
        self.lowest_full = math.inf  # the lowest mean over a full window so far

    def add(self, confidence: float) -> None:
        self.recent.append(confidence)
        self.total += confidence
        self.num_tokens += 1
        if len(self.recent) > self.window:
            self.total -= self.recent.popleft()
        if self.is_full:
            self.lowest_full = min(self.lowest_full, self.group)

    @property
    def is_full(self) -> bool:
        """Whether the window holds `window` tokens: only then is the group confidence checked."""
        return len(self.recent) == self.window

    @property
    def group(self) -> float:
        """The mean confidence of the latest window (of all tokens while fewer than `window`)."""
        return self.total / len(self.recent) if self.recent else math.inf

    @property
    def lowest(self) -> float:
        """The lowest group confidence over the trace's windows; a trace shorter than one window has
        one group, all its tokens (as the paper's code takes it)."""
        return self.lowest_full if self.lowest_full < math.inf else self.group


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile of `values`, interpolated linearly between ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)
