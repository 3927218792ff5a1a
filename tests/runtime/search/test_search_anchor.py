"""The greedy anchor: one path decoded at temperature 0 beside the strategy's, the answer unless a
candidate outranks it by the verifier's margin (runtime.search.anchor)."""


import pytest

from runtime.search.anchor import anchor_first, outranks
from runtime.search.controller import SearchController
from runtime.verify.scoring import CalculatorScorer, ConfidenceScorer, JudgeScorer
from runtime.wire.params import SamplingParams, SearchParams
from runtime.wire.protocol import Delta, Finished, GenerateRequest
from tests.runtime.engine_helpers import engine_for
from tests.runtime.search.test_search_engine import run_search

QUESTION = "w1 w2 w3"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return engine_for(tiny_llama, num_blocks=1024)


@pytest.fixture(autouse=True)
def candidates(monkeypatch):
    """Every search's final candidates as (token ids, score), kept as it answers."""
    kept = {}
    finish = SearchController._finish

    def spy(self):
        kept[self.request_id] = [(tuple(p.seq.token_ids[len(self.prompt_ids):p.step_end]), p.score)
                                 for p in self.final]
        finish(self)

    monkeypatch.setattr(SearchController, "_finish", spy)
    return kept


def search(engine, request_id, *, temperature=1.0, **fields):
    """(the answer's token ids, the Finished message) of one search of the tiny model."""
    params = dict(strategy="best_of_n", n=4, beam_width=2, max_steps=3, max_step_tokens=4, verifier="confidence")
    params.update(fields)
    request = GenerateRequest(request_id=request_id, endpoint="chat", messages=({"role": "user", "content": QUESTION},),
                              sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=3,
                                                      ignore_eos=True),
                              search=SearchParams(**params))
    messages = run_search(engine, request)
    answer = next(m for m in messages if isinstance(m, Delta) and m.search is not None)
    return answer.token_ids, messages[-1]


def greedy_tokens(engine):
    """Plain greedy decoding of the same chat, for the anchor to match token for token."""
    request = GenerateRequest(request_id="greedy", endpoint="chat", messages=({"role": "user", "content": QUESTION},),
                              sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    messages = run_search(engine, request)
    return tuple(t for m in messages if isinstance(m, Delta) for t in m.token_ids)


@pytest.mark.parametrize("strategy", ["best_of_n", "beam", "dvts", "dynamic_branching"])
def test_the_anchor_is_greedy_decoding_and_leaves_the_sampled_paths_as_they_were(engine, candidates, strategy):
    """Every candidate of the search without the anchor is a candidate with it, token for token, and the
    one more is greedy decoding's text (the strategy never sees the anchor; the paths keep their seeds)."""
    _, finished = search(engine, f"on-{strategy}", strategy=strategy)
    _, plain = search(engine, f"off-{strategy}", strategy=strategy, greedy_anchor=False)
    greedy = greedy_tokens(engine)
    with_anchor, without = candidates[f"on-{strategy}"], candidates[f"off-{strategy}"]
    assert sorted(ids for ids, _ in with_anchor) == sorted([ids for ids, _ in without] + [greedy])
    assert finished.search.anchor_tokens == len(greedy) == MAX_TOKENS
    assert finished.search.tokens_generated == plain.search.tokens_generated + MAX_TOKENS
    assert finished.search.paths_explored == plain.search.paths_explored + 1
    assert plain.search.answered_by_anchor is None and plain.search.anchor_tokens == 0
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("verifier, by_anchor", [("confidence", True), ("judge", False)])
@pytest.mark.parametrize("n", [2, 8])
def test_the_answer_is_greedy_unless_a_candidate_scores_higher(engine, candidates, n, verifier, by_anchor):
    """Outside the calculator the margin is a strictly higher score: the answer is the best sampled path
    when it beats greedy's score, else greedy's text. On the tiny model greedy's text is the most
    confident (it stands), and the judge prefers a sampled one (it is outranked)."""
    request_id = f"rule-{n}-{verifier}"
    answer, finished = search(engine, request_id, n=n, verifier=verifier)
    greedy = greedy_tokens(engine)
    anchor_score = next(score for ids, score in candidates[request_id] if ids == greedy)
    best_other = max(score for ids, score in candidates[request_id] if ids != greedy)
    assert finished.search.answered_by_anchor == (answer == greedy) == (best_other <= anchor_score) == by_anchor
    if answer != greedy:
        assert dict(candidates[request_id])[answer] == best_other


def test_with_the_same_seed_a_search_with_its_anchor_repeats_token_for_token(engine, candidates):
    first, _ = search(engine, "again-1", strategy="beam")
    second, _ = search(engine, "again-2", strategy="beam")
    assert first == second and candidates["again-1"] == candidates["again-2"]


@pytest.mark.parametrize("fields, temperature", [(dict(greedy_anchor=False), 1.0), ({}, 0.0)])
def test_no_anchor_when_turned_off_or_when_every_path_is_greedy(engine, fields, temperature):
    _, finished = search(engine, f"none-{temperature}", temperature=temperature, **fields)
    assert finished.search.answered_by_anchor is None and finished.search.anchor_tokens == 0
    assert finished.search.paths_explored == 4


def test_a_vote_has_no_anchor_rule(engine):
    _, finished = search(engine, "vote", select="majority")
    assert finished.search.answered_by_anchor is False and finished.search.anchor_tokens == MAX_TOKENS


def test_the_calculator_s_margin_is_a_tier():
    calculator = CalculatorScorer(tokenizer=None)  # scores given here: nothing to decode
    unchecked_sure, unchecked_unsure = (2 + 0.99) / 4, (2 + 0.1) / 4
    checked_unsure, unsupported_sure = (3 + 0.01) / 4, (1 + 1.0) / 4
    assert outranks(calculator, checked_unsure, unchecked_sure)
    assert not outranks(calculator, unchecked_sure, unchecked_unsure)  # the same tier: greedy stands
    assert not outranks(calculator, unsupported_sure, unchecked_unsure)  # (1 + 1.0) / 4 is tier 1 at full confidence
    assert outranks(calculator, unchecked_unsure, unsupported_sure)
    assert outranks(calculator, 0.1, float("-inf")) and not outranks(calculator, float("-inf"), 0.1)
    plain = ConfidenceScorer()  # a verifier without a margin of its own: a strictly higher score
    assert outranks(plain, 0.51, 0.5) and not outranks(plain, 0.5, 0.5)
    assert JudgeScorer.outranks(0.51, 0.5) and not JudgeScorer.outranks(0.5, 0.5)


def test_anchor_first_moves_the_anchor_before_what_does_not_outrank_it():
    plain = ConfidenceScorer()
    assert anchor_first([2, 0, 1], [0.3, 0.1, 0.9], 1, plain) == [2, 0, 1]  # 0.9 beats greedy's 0.1
    assert anchor_first([2, 0, 1], [0.3, 0.9, 0.9], 1, plain) == [1, 2, 0]  # a tie keeps greedy
    assert anchor_first([1, 0], [0.3, 0.9], 1, plain) == [1, 0]


def test_an_anchored_search_with_look_ahead_finishes(engine):
    """The anchor's greedy roll-out is its next step word for word, so the judge is asked the same
    question twice: the second question, forked whole from the first, still computes its last token
    (it waited for logits forever before)."""
    params = dict(strategy="beam", n=8, beam_width=2, max_steps=40, max_step_tokens=4, verifier="judge", lookahead=1)
    request = GenerateRequest(request_id="anchor-lookahead", endpoint="chat",
                              messages=({"role": "user", "content": QUESTION},),
                              sampling=SamplingParams(max_tokens=48, temperature=1.0, seed=3, ignore_eos=True),
                              search=SearchParams(**params))
    assert not isinstance(engine.add_request(request)[0], Finished)
    messages = []
    for _ in range(5000):
        if not engine.has_work:
            break
        messages += engine.step()
    assert not engine.has_work, "the search did not finish"
    finished = messages[-1]
    assert isinstance(finished, Finished) and finished.search.anchor_tokens == 48
    engine.check_integrity()
