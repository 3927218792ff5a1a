"""Particle filtering: its weights, its seeded resampling, and a search run with it."""

import math
import random
from types import SimpleNamespace

import msgspec
import pytest

from runtime.search.strategies import Expansion, ParticleFiltering, make_strategy, particle_weights
from runtime.wire.protocol import Delta
from tests.runtime.engine_helpers import engine_for
from tests.runtime.search.test_search_engine import engine_choices, run_search, search_request


def test_weights_are_the_softmax_of_the_scores_logits():
    scores = [0.9, 0.5, 0.2]
    logits = [math.log(s / (1 - s)) for s in scores]
    expected = [math.exp(x) / sum(math.exp(y) for y in logits) for x in logits]
    assert particle_weights(scores) == pytest.approx(expected, rel=1e-12)
    assert particle_weights([0.5, 0.5]) == [0.5, 0.5]


def test_weights_clip_certain_scores_and_give_none_to_unscored_particles():
    clipped = particle_weights([1.0, 0.0])  # its_hub's clip: logit(1 - 1e-7) against logit(1e-7)
    assert clipped[0] == pytest.approx(1.0) and clipped[1] == pytest.approx(((1e-7) / (1 - 1e-7)) ** 2, rel=1e-6)
    assert particle_weights([0.3, float("-inf")]) == [1.0, 0.0]
    assert particle_weights([float("-inf")] * 4) == [0.25] * 4


def path(uid, score, done=False):
    return SimpleNamespace(uid=uid, score=score, is_done=done, subtree=0, text=str(uid))


def test_resampling_draws_n_particles_from_the_seeded_generator():
    live = [path(0, 0.9), path(1, 0.2), path(2, 0.6)]
    strategy = make_strategy("particle_filtering", 8, 4, seed=7)
    draws = random.Random(7).choices(range(3), weights=particle_weights([0.9, 0.2, 0.6]), k=8)
    counts = {uid: draws.count(uid) for uid in range(3) if draws.count(uid)}
    assert strategy.expand(live) == Expansion(tuple(counts), tuple(counts.values()))
    assert sum(counts.values()) == 8
    again = make_strategy("particle_filtering", 8, 4, seed=7)
    assert again.expand(list(reversed(live))) == Expansion(tuple(counts), tuple(counts.values()))  # order-free


def test_finished_particles_keep_their_weight_and_take_draws_from_the_live():
    strategy = ParticleFiltering(16, 4, seed=1)
    final, live = strategy.settle([path(0, 0.99, done=True), path(1, 0.3), path(2, 0.4)])
    assert [p.uid for p in final] == [0] and [p.uid for p in live] == [1, 2]
    draws = random.Random(1).choices(range(3), weights=particle_weights([0.3, 0.4, 0.99]), k=16)
    expansion = strategy.expand(live)
    assert sum(expansion.children) == 16 - draws.count(2) < 16  # the finished one drew some: fewer run on
    assert expansion == Expansion(*zip(*[(u, draws.count(i)) for i, u in enumerate((1, 2)) if draws.count(i)]))
    assert strategy.expand([]) == Expansion((), ())


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return engine_for(tiny_llama, num_blocks=1024)


def particles(engine, request_id, seed, **search):
    request = search_request(request_id, strategy="particle_filtering", n=8, max_steps=5, **search)
    request = msgspec.structs.replace(request, sampling=msgspec.structs.replace(request.sampling, seed=seed))
    messages = run_search(engine, request)
    assert engine.pool.num_used == 0
    return engine_choices(messages), [m.token_ids for m in messages if isinstance(m, Delta) and m.search], messages[-1]


@pytest.mark.parametrize("verifier", ["confidence", "judge"])
def test_the_same_seed_gives_the_same_tokens_and_another_seed_other_ones(engine, verifier):
    first = particles(engine, "pf-a", 11, verifier=verifier)
    second = particles(engine, "pf-b", 11, verifier=verifier)
    other = particles(engine, "pf-c", 12, verifier=verifier)
    assert first[:2] == second[:2] and first[1] != other[1]
    assert first[2].search.strategy == "particle_filtering" and first[2].search.paths_explored > 8


def test_without_the_anchor_the_search_is_the_strategy_s_own(engine):
    """The anchor is never a particle: the particles' tokens are the same with it and without it."""
    _, with_anchor, on = particles(engine, "pf-on", 3, greedy_anchor=True, select="majority")
    _, without, off = particles(engine, "pf-off", 3, greedy_anchor=False, select="majority")
    assert on.search.tokens_generated == off.search.tokens_generated + on.search.anchor_tokens
    assert on.search.paths_explored == off.search.paths_explored + 1
