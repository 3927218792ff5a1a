"""Search strategies: after each verified step, which paths go on and with how many children.

A strategy is a small object over the shared step loop in `SearchController`; it never touches
sequences or KV, only the paths' scores and states, and returns an `Expansion`: for every parent
path that continues, how many children it gets (a parent with one child simply continues).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from runtime.search.aggregate import allocate_children, refill
from runtime.search.confidence import TraceConfidence, percentile


class PathView(Protocol):
    uid: int
    subtree: int
    is_done: bool
    text: str

    @property
    def score(self) -> float: ...


@dataclass(frozen=True)
class Expansion:
    """`children[i]` children for `parents[i]`; parents not listed are pruned (or done)."""

    parents: tuple[int, ...]  # path uids
    children: tuple[int, ...]


def rank(paths: Sequence[PathView]) -> list[PathView]:
    """Best aggregated score first; ties by path uid, so the order is a function of the scores alone."""
    return sorted(paths, key=lambda p: (-p.score, p.uid))


def drop_duplicates(paths: Sequence[PathView]) -> list[PathView]:
    seen: set[str] = set()
    kept = []
    for path in sorted(paths, key=lambda p: p.uid):
        if path.text not in seen:
            seen.add(path.text)
            kept.append(path)
    return kept


def _outranked(ended: Sequence[PathView], keep: int) -> set[int]:
    """The uids of the paths of `ended` out of `rank(drop_duplicates(live))[:keep]` whatever other paths
    join them: a path of its text with a lower uid drops it, or `keep` other texts rank above it (paths
    of one text have one score: the same tokens), and paths joining only add to them."""
    lowest: dict[str, int] = {}
    for p in ended:
        lowest[p.text] = min(lowest.get(p.text, p.uid), p.uid)
    out, above = set(), set()
    for p in rank(ended):
        if lowest[p.text] < p.uid or len(above) >= keep:
            out.add(p.uid)
        above.add(p.text)
    return out


def _counts(parents: Sequence[PathView], total: int) -> Expansion:
    """Cyclic refill of `parents` (best first) to `total` paths, as children counts per parent."""
    counts: dict[int, int] = {}
    for parent in refill(list(parents), total):
        counts[parent.uid] = counts.get(parent.uid, 0) + 1
    order = [p.uid for p in parents if p.uid in counts]
    return Expansion(tuple(order), tuple(counts[u] for u in order))


class Strategy:
    name = ""
    #: a subtree stops when its path emits this text (DVTS)
    stops_on_boxed = False
    #: whether a path may get new children when it settles (speculation decodes them ahead)
    expands = True
    #: every step runs its paths to their end (no step delimiter): a step is a wave of whole traces
    whole_traces = False
    #: whether the request's verifier scores the paths
    uses_verifier = True
    #: > 0: the sampler reports each token's confidence over this many top tokens (`observe`)
    confidence_k = 0
    #: the answer's selection rule, or None: the request's `select`
    selection: str | None = None
    #: its expansion is a function of the live paths' scores, texts and uids alone (no draws, no
    #: history), so speculation may replay it over the steps decoded ahead (runtime.search.projection)
    expands_by_scores = False

    def __init__(self, n: int, beam_width: int, seed: int | None = None) -> None:
        self.n = n
        self.beam_width = beam_width
        self.seed = seed  # the request's sampling seed: a strategy that draws at random draws from it

    def initial_paths(self) -> list[int]:
        """The subtree of each initial path (all start from the prompt)."""
        return [0] * self.n

    def settle(self, stepped: Sequence[PathView]) -> tuple[list[PathView], list[PathView]]:
        """Split the paths that just took a verified step into (final candidates, still live)."""
        return [p for p in stepped if p.is_done], [p for p in stepped if not p.is_done]

    def expand(self, live: Sequence[PathView]) -> Expansion:
        raise NotImplementedError

    @property
    def keep(self) -> int:
        """How many live paths a beam keeps when a step settles (beam search, dynamic branching)."""
        return max(1, self.n // self.beam_width)

    def widest_child(self, num_live: int) -> int:
        """How many children speculation decodes ahead for one survivor when `num_live` live paths
        settle: the most it gets where the count alone tells (beam search), else `beam_width`."""
        return self.beam_width

    def surely_pruned(self, ended: Sequence[PathView]) -> set[int]:
        """The uids of the live paths `ended`, which ended the step with their final scores, that are
        pruned when it settles whatever the paths still decoding do."""
        return set()

    def num_first_wave(self) -> int:
        """How many of the initial paths start at once; the others start, forked from the prompt, when
        none of those is live any more."""
        return len(self.initial_paths())

    def observe(self, uid: int, confidence: float) -> bool:
        """A token of path `uid` and its confidence (with `confidence_k`): whether the path stops here."""
        return False

    def candidates(self, final: Sequence[PathView]) -> tuple[list[PathView], list[float]]:
        """The finished paths the answer is chosen among, and the score each is ranked and weighed by."""
        return list(final), [p.score for p in final]


class BestOfN(Strategy):
    """n independent samples, each verified at every step; nothing is pruned."""

    name = "best_of_n"
    expands = False

    def expand(self, live: Sequence[PathView]) -> Expansion:
        ordered = sorted(live, key=lambda p: p.uid)
        return Expansion(tuple(p.uid for p in ordered), tuple(1 for _ in ordered))


class BeamSearch(Strategy):
    """Keep the best n // beam_width live paths and refill to n by cyclic duplication."""

    name = "beam"
    expands_by_scores = True

    def expand(self, live: Sequence[PathView]) -> Expansion:
        survivors = rank(drop_duplicates(live))[:self.keep]
        return _counts(survivors, self.n) if survivors else Expansion((), ())

    def surely_pruned(self, ended: Sequence[PathView]) -> set[int]:
        return _outranked(ended, self.keep)

    def widest_child(self, num_live: int) -> int:
        """Fewer survivors than it keeps share all `n` children (the refill)."""
        return math.ceil(self.n / min(self.keep, max(1, num_live)))


class DynamicBranching(Strategy):
    """Beam search whose children per survivor are proportional to its score."""

    name = "dynamic_branching"
    expands_by_scores = True

    def expand(self, live: Sequence[PathView]) -> Expansion:
        survivors = rank(drop_duplicates(live))[:self.keep]
        if not survivors:
            return Expansion((), ())
        counts = allocate_children([p.score for p in survivors], self.n)
        pairs = [(p.uid, c) for p, c in zip(survivors, counts) if c > 0]
        return Expansion(tuple(u for u, _ in pairs), tuple(c for _, c in pairs))

    def surely_pruned(self, ended: Sequence[PathView]) -> set[int]:
        return _outranked(ended, self.keep)


class DVTS(Strategy):
    """n // beam_width independent subtrees; each keeps its own best path and re-expands it."""

    name = "dvts"
    stops_on_boxed = True

    def initial_paths(self) -> list[int]:
        return [i // self.beam_width for i in range(self.n)]

    def expand(self, live: Sequence[PathView]) -> Expansion:
        parents, children = [], []
        for subtree in sorted({p.subtree for p in live}):
            best = rank([p for p in live if p.subtree == subtree])[0]
            parents.append(best.uid)
            children.append(self.beam_width)
        return Expansion(tuple(parents), tuple(children))

    def settle(self, stepped: Sequence[PathView]) -> tuple[list[PathView], list[PathView]]:
        """A subtree whose best candidate is done (EOS, empty step or a boxed answer) stops, and all
        its candidates become final; otherwise only its best candidate lives on."""
        final, live = [], []
        for subtree in sorted({p.subtree for p in stepped}):
            candidates = [p for p in stepped if p.subtree == subtree]
            best = rank(candidates)[0]
            if best.is_done:
                final.extend(candidates)
            else:
                live.append(best)
        return final, live


# its_hub's clip before the logit: a score of exactly 0 or 1 would weigh -inf or +inf.
SCORE_CLIP = 1e-7


class ParticleFiltering(Strategy):
    """Particle filtering (Puri et al. 2025), weighted as its_hub weighs it: the n paths are particles;
    after each verified step every particle, live or finished, weighs softmax(logit(score)) over them
    all (score clipped to [1e-7, 1 - 1e-7]), and n particles are drawn with those weights, with
    replacement (multinomial resampling). A live particle drawn k times goes on with k children, one
    never drawn is pruned; a draw of a finished particle keeps nothing running (its answer is already
    a candidate), so the live set shrinks as the finished ones gain weight. The draws come from a
    generator seeded with the request's seed: the same seed gives the same tokens."""

    name = "particle_filtering"

    def __init__(self, n: int, beam_width: int, seed: int | None = None) -> None:
        super().__init__(n, beam_width, seed)
        self.rng = random.Random(seed) if seed is not None else random.Random()
        self.finished: list[PathView] = []  # stays in the population: its weight keeps drawing

    def settle(self, stepped: Sequence[PathView]) -> tuple[list[PathView], list[PathView]]:
        final, live = super().settle(stepped)
        self.finished.extend(sorted(final, key=lambda p: p.uid))
        return final, live

    def expand(self, live: Sequence[PathView]) -> Expansion:
        live = sorted(live, key=lambda p: p.uid)
        population = live + self.finished
        if not live:
            return Expansion((), ())
        draws = self.rng.choices(range(len(population)), weights=particle_weights([p.score for p in population]),
                                 k=self.n)
        counts = [draws.count(i) for i in range(len(live))]
        pairs = [(p.uid, c) for p, c in zip(live, counts) if c > 0]
        return Expansion(tuple(u for u, _ in pairs), tuple(c for _, c in pairs))


def particle_weights(scores: Sequence[float]) -> list[float]:
    """softmax(logit(score)) over the particles; a particle never scored (-inf) weighs nothing, unless
    none was scored (then all weigh the same)."""
    logits = [_logit(score) for score in scores]
    top = max(logits)
    if top == -math.inf:
        return [1.0 / len(scores)] * len(scores)
    exps = [math.exp(x - top) for x in logits]
    total = math.fsum(exps)
    return [e / total for e in exps]


def _logit(score: float) -> float:
    if not math.isfinite(score):
        return -math.inf
    clipped = min(max(score, SCORE_CLIP), 1 - SCORE_CLIP)
    return math.log(clipped / (1 - clipped))


# The paper's k: a token's confidence is over the model's 20 most likely tokens at its position.
CONFIDENCE_TOP_K = 20


class DeepConf(Strategy):
    """DeepConf online (Fu et al. 2025): no verifier. A warm-up of `warmup` traces runs to its end; the
    stopping threshold is the (100 - eta)-th percentile of their lowest group confidences. The other
    n - warmup traces then run, and each stops the moment its group confidence (the mean token
    confidence over its latest `window` tokens) falls below the threshold; a stopped trace does not
    vote. The answer is the confidence-weighted majority of the traces that finished (weight: a trace's
    lowest group confidence), with `keep_top` only of the top `eta` % of them by that weight."""

    name = "deepconf"
    expands = False
    whole_traces = True
    uses_verifier = False
    confidence_k = CONFIDENCE_TOP_K
    selection = "weighted_majority"

    def __init__(self, n: int, beam_width: int, seed: int | None = None, *, warmup: int | None = None,
                 eta: float = 10.0, window: int = 256, keep_top: bool = False) -> None:
        super().__init__(n, beam_width, seed)
        self.warmup = min(n, warmup if warmup is not None else max(1, n // 4))
        self.eta, self.window, self.keep_top = eta, window, keep_top
        self.traces: dict[int, TraceConfidence] = {}
        self.threshold: float | None = None  # set when the warm-up is done
        self.stopped: set[int] = set()  # traces stopped by their confidence: pruned when they settle

    def num_first_wave(self) -> int:
        return self.warmup

    def observe(self, uid: int, confidence: float) -> bool:
        trace = self.traces.setdefault(uid, TraceConfidence(self.window))
        trace.add(confidence)
        if self.threshold is None or not trace.is_full or trace.group >= self.threshold:
            return False
        self.stopped.add(uid)
        return True

    def lowest(self, uid: int) -> float:
        trace = self.traces.get(uid)
        return trace.lowest if trace is not None else -math.inf

    def settle(self, stepped: Sequence[PathView]) -> tuple[list[PathView], list[PathView]]:
        kept = sorted((p for p in stepped if p.uid not in self.stopped), key=lambda p: p.uid)
        final, live = [p for p in kept if p.is_done], [p for p in kept if not p.is_done]
        if self.threshold is None and not live:  # the warm-up is done
            lowest = [self.lowest(p.uid) for p in final]
            self.threshold = percentile(lowest, 100.0 - self.eta) if lowest else None
        return final, live

    def expand(self, live: Sequence[PathView]) -> Expansion:
        ordered = sorted(live, key=lambda p: p.uid)
        return Expansion(tuple(p.uid for p in ordered), tuple(1 for _ in ordered))

    def candidates(self, final: Sequence[PathView]) -> tuple[list[PathView], list[float]]:
        final = list(final)
        if self.keep_top and final:
            ranked = sorted(final, key=lambda p: (-self.lowest(p.uid), p.uid))
            kept = {id(p) for p in ranked[:max(1, math.ceil(len(ranked) * self.eta / 100.0))]}
            final = [p for p in final if id(p) in kept]
        return final, [self.lowest(p.uid) for p in final]


STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (BestOfN, BeamSearch, DynamicBranching, DVTS,
                                                                   ParticleFiltering, DeepConf)}


def make_strategy(name: str, n: int, beam_width: int, seed: int | None = None, **options) -> Strategy:
    """`options`: the knobs of a strategy that has them (DeepConf's `warmup`, `eta`, `window`, `keep_top`)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown search strategy {name!r}; expected one of {', '.join(STRATEGIES)}")
    if name == "dvts" and n % beam_width:
        raise ValueError("dvts needs n to be a multiple of beam_width")
    if name == "deepconf":
        return DeepConf(n, beam_width, seed, **options)
    return STRATEGIES[name](n, beam_width, seed)
