"""DeepConf: its confidence measures, its threshold and vote, and a search run with it."""

import math

import msgspec
import numpy as np
import pytest
import torch

from runtime.model.sampler import SamplingState, sample
from runtime.search.answers import Candidate, select
from runtime.search.confidence import TraceConfidence, percentile
from runtime.search.strategies import DeepConf, make_strategy
from runtime.wire.params import SamplingParams
from runtime.wire.protocol import Delta, Finished, SearchEvent
from tests.runtime.engine_helpers import engine_for
from tests.runtime.search.test_search_engine import engine_choices, search_request
from tests.runtime.search.test_search_particles import path
from tests.runtime.search.test_search_timeout import clock, run  # noqa: F401 (a fixture)


def test_group_confidence_is_the_window_mean_and_lowest_the_least_full_window():
    trace = TraceConfidence(3)
    for value in (4.0, 2.0, 3.0):
        trace.add(value)
    assert trace.is_full and trace.group == 3.0 and trace.lowest == 3.0
    for value in (1.0, 5.0, 6.0):
        trace.add(value)
    assert trace.group == pytest.approx(4.0) and trace.lowest == pytest.approx(2.0)  # (2 + 3 + 1) / 3
    short = TraceConfidence(8)
    short.add(2.0), short.add(4.0)
    assert not short.is_full and short.lowest == 3.0  # shorter than a window: one group of all its tokens


def test_percentile_interpolates_as_numpy():
    values = [3.1, 0.5, 2.0, 7.25, 4.0]
    for q in (0, 10, 37.5, 90, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def feed(strategy, uid, values):
    return [strategy.observe(uid, v) for v in values]


def test_the_threshold_comes_from_the_warmup_and_stops_a_later_trace_at_once():
    strategy = make_strategy("deepconf", 8, 4, seed=0, warmup=2, eta=10.0, window=2)
    assert isinstance(strategy, DeepConf) and strategy.num_first_wave() == 2
    assert feed(strategy, 0, [5.0, 5.0, 1.0, 5.0]) == [False] * 4  # warm-up traces never stop
    feed(strategy, 1, [4.0, 4.0, 4.0])
    final, live = strategy.settle([path(0, -math.inf, done=True), path(1, -math.inf, done=True)])
    assert [p.uid for p in final] == [0, 1] and live == []
    assert strategy.threshold == pytest.approx(percentile([3.0, 4.0], 90))  # lowest groups: 3.0 and 4.0
    # A full window below the threshold stops the trace on that token; a first low token does not.
    assert feed(strategy, 2, [1.0, 9.0, 9.0, 3.0, 4.0]) == [False, False, False, False, True]
    assert feed(strategy, 3, [9.0, 9.0, 9.0]) == [False] * 3
    final, live = strategy.settle([path(2, -math.inf, done=True), path(3, -math.inf, done=True)])
    assert [p.uid for p in final] == [3]  # the stopped trace does not vote


def test_the_vote_weighs_each_trace_by_its_lowest_group_confidence():
    strategy = DeepConf(4, 4, warmup=4, eta=50.0, window=1)
    for uid, values, answer in ((0, [1.0], "7"), (1, [1.5], "7"), (2, [3.0], "9"), (3, [0.2], "7")):
        feed(strategy, uid, values)
    final = [path(uid, -math.inf, done=True) for uid in range(4)]
    answers = ["7", "7", "9", "7"]
    voters, weights = strategy.candidates(final)
    assert voters == final and weights == [1.0, 1.5, 3.0, 0.2]
    order = select([Candidate(a, w) for a, w in zip(answers, weights)], strategy.selection)
    assert order == [2, 1, 0, 3]  # "9" weighs 3.0 against the three "7"s' 2.7
    assert select([Candidate(a, w) for a, w in zip(answers, weights)], "majority")[0] == 1  # unweighted: "7"
    strategy.keep_top = True  # only the top 50 %: traces 2 and 1
    voters, weights = strategy.candidates(final)
    assert [p.uid for p in voters] == [1, 2] and weights == [1.5, 3.0]
    assert select([Candidate(answers[p.uid], w) for p, w in zip(voters, weights)], "weighted_majority") == [1, 0]


def test_the_sampler_reports_minus_the_mean_of_the_top_k_logprobs_whatever_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, max_tokens=4)
    states = [SamplingState(params, 5 + i, torch.device("cpu"), confidence_k=k) for i, k in enumerate((20, 0, 7))]
    outs = sample(logits, states, [([], [])] * 3)
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    assert outs[0].confidence == pytest.approx(-logprobs[0].topk(20).values.mean().item(), rel=1e-6)
    assert outs[1].confidence is None
    assert outs[2].confidence == pytest.approx(-logprobs[2].topk(7).values.mean().item(), rel=1e-6)
    alone = sample(logits[2:], [SamplingState(params, 7, torch.device("cpu"), confidence_k=7)], [([], [])])
    assert (alone[0].token_id, alone[0].confidence) == (outs[2].token_id, outs[2].confidence)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return engine_for(tiny_llama, num_blocks=1024)


def deepconf_request(request_id, seed=11, **search):
    options = dict(strategy="deepconf", n=8, deepconf_warmup=2, deepconf_window=4, greedy_anchor=False)
    options.update(search)
    request = search_request(request_id, **options)
    return msgspec.structs.replace(request, sampling=msgspec.structs.replace(request.sampling, seed=seed))


def traced(engine, request):
    """Run `request`; its controller, every path's tokens as the search saw them, and the messages."""
    engine.add_request(request)
    controller = engine.searches[request.request_id]
    tokens: dict[int, list[int]] = {}
    controller.seen = {}  # uid: the confidence of each token
    on_token = controller.on_token

    def spy(path, out):
        tokens.setdefault(path.uid, []).append(out.token_id)
        controller.seen.setdefault(path.uid, []).append(out.confidence)
        on_token(path, out)

    controller.on_token = spy
    messages = []
    while engine.has_work:
        messages += engine.step()
        engine.check_integrity()
    assert engine.pool.num_used == 0
    return controller, tokens, messages


def test_the_same_seed_gives_the_same_tokens_and_another_seed_other_ones(engine):
    first = traced(engine, deepconf_request("dc-a", 11))
    second = traced(engine, deepconf_request("dc-b", 11))
    other = traced(engine, deepconf_request("dc-c", 12))
    assert first[1] == second[1] and engine_choices(first[2]) == engine_choices(second[2])
    assert first[1] != other[1]
    summary = first[2][-1].search
    assert summary.strategy == "deepconf" and summary.steps == 2 and summary.paths_explored == 8
    assert summary.verifier_calls == 0


def test_a_trace_below_the_threshold_stops_there_and_is_best_of_n_s_trace_cut_short(engine):
    """The traces are best-of-n's own (same seeds, the later wave forked from the kept prompt); a stopped
    one ends at the token whose window fell below the warm-up's threshold, and no token comes after it."""
    controller, tokens, messages = traced(engine, deepconf_request("dc-stop", 11, deepconf_eta=10.0))
    strategy = controller.strategy
    _, plain, _ = traced(engine, deepconf_request("dc-plain", 11, strategy="best_of_n", max_steps=1))
    assert strategy.threshold == pytest.approx(percentile([strategy.lowest(0), strategy.lowest(1)], 90))
    assert strategy.stopped and strategy.stopped <= set(range(2, 8))
    for uid in range(8):
        assert tokens[uid] == plain[uid][:len(tokens[uid])]
        trace, groups = TraceConfidence(4), []
        for confidence in controller.seen[uid]:
            trace.add(confidence)
            groups.append(trace.group if trace.is_full else math.inf)
        if uid in strategy.stopped:  # on the first full window below the threshold, and not a token later
            assert groups[-1] < strategy.threshold and min(groups[:-1]) >= strategy.threshold
            assert len(tokens[uid]) < len(plain[uid])
        else:
            assert uid < 2 or min(groups) >= strategy.threshold
            assert tokens[uid] == plain[uid]
    summary = messages[-1].search
    assert summary.tokens_generated == sum(map(len, tokens.values())) < sum(map(len, plain.values()))
    chosen = [m for m in messages if isinstance(m, Delta) and m.search is not None]
    assert {m.search.score for m in chosen} <= {strategy.lowest(u) for u in set(range(8)) - strategy.stopped}



def test_it_streams_the_committed_prefix_events_and_the_summary(engine):
    _, _, messages = traced(engine, deepconf_request("dc-stream", 3, n=4, deepconf_warmup=1, greedy_anchor=True))
    deltas = [m for m in messages if isinstance(m, Delta) and m.index == 0]
    assert "".join(d.text for d in deltas) == engine_choices(messages)[0][0] and deltas[-1].finish_reason
    assert [e.step for e in messages if isinstance(e, SearchEvent)] == [1, 2]  # the warm-up, then the rest
    finished = messages[-1]
    assert isinstance(finished, Finished) and finished.search.strategy == "deepconf"
    assert finished.search.paths_explored == 5 and finished.search.anchor_tokens > 0
    assert finished.completion_tokens == finished.search.tokens_returned > 0


@pytest.mark.parametrize("steps", [2, 12])  # in the warm-up (the prompt kept for the rest), in the later wave
def test_abort_frees_every_block(engine, steps):
    engine.add_request(deepconf_request("dc-abort", 5, deepconf_eta=90.0))
    for _ in range(steps):
        engine.step()
    assert engine.pool.num_used > 0
    engine.abort("dc-abort")
    assert engine.pool.num_used == 0 and not engine.has_work
    engine.check_integrity()


@pytest.mark.parametrize("jump_after_step", [0, 1])
def test_a_search_out_of_time_answers_with_the_traces_it_has(tiny_llama, clock, jump_after_step):
    engine = engine_for(tiny_llama, num_blocks=1024)
    full = deepconf_request("dc-full", 4, timeout_s=60, deepconf_eta=90.0)
    _, summary_full = run(engine, full, clock, jump_after_step=None)
    deltas, summary = run(engine, msgspec.structs.replace(full, request_id="dc-cut"), clock, jump_after_step)
    assert summary.timed_out is True and summary.steps == jump_after_step + 1  # no later wave starts
    assert summary.tokens_generated < summary_full.tokens_generated and deltas
    assert engine.searches == {} and engine.pool.num_used == 0
