"""The greedy anchor: a search is never worse than greedy decoding by construction.

With `greedy_anchor` (the default) and a sampling temperature above 0, the search forks one more path
from the prompt, beside the strategy's n: it decodes at temperature 0, so its tokens are greedy
decoding's, and it shares the prompt's KV like every path. The strategy never sees it: it is neither
pruned nor duplicated; it steps, is verified and finishes with the others (a search goes on while it
lives), so its score is the same verifier's on the same schedule.

The rule, with `select = "best"`: the search answers with its best candidate only when that candidate
outranks the anchor by the verifier's margin; otherwise the anchor's (greedy) text is the answer.
- `calculator`: outranking is a higher tier (checked over unchecked, unchecked over unsupported, ...);
  within one tier the greedy path stands, whatever the confidences say.
- every other verifier: a strictly higher aggregated score.
A vote (`majority`, `weighted_majority`) ranks answers by their counts, not by scores, so there the
anchor is one more vote and no rule applies.

Its cost is the greedy pass's tokens (`SearchSummary.anchor_tokens`), decoded in the same batches as
the search's paths; `answered_by_anchor` says which rule decided.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from runtime.search.host import Verifier
from runtime.wire.params import SamplingParams

ANCHOR_UID = -1  # never a sampled path's number: the sampled paths' seeds stay what they were without it


def anchor_params(params: SamplingParams) -> SamplingParams:
    return msgspec.structs.replace(params, temperature=0.0)


def outranks(verifier: Verifier, score: float, anchor_score: float) -> bool:
    """Whether a candidate scored `score` beats the anchor scored `anchor_score` by `verifier`'s margin."""
    if not math.isfinite(score):
        return False
    if not math.isfinite(anchor_score):
        return True
    return verifier.outranks(score, anchor_score)


def anchor_first(order: Sequence[int], scores: Sequence[float], anchor: int, verifier: Verifier) -> list[int]:
    """`order` (candidate indices, best first) with the anchor `anchor` moved first unless the best
    candidate outranks it."""
    order = list(order)
    if order[0] == anchor or outranks(verifier, scores[order[0]], scores[anchor]):
        return order
    order.remove(anchor)
    return [anchor, *order]
