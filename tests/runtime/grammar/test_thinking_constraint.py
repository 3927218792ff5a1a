"""A thinking model's phases per sequence (runtime.grammar.thinking): thinking tokens counted, the closing
text forced once the budget is spent, and the request's grammar asked only for the answer."""

from __future__ import annotations

import numpy as np

from runtime.grammar.matcher import refused_tokens, step_masks
from runtime.grammar.thinking import ANSWER, BEFORE, CLOSING, THINKING, ThinkingConstraint, ThinkingMarkers

OPEN, CLOSE, NL = 40, 41, 7
MARKERS = ThinkingMarkers(OPEN, CLOSE, (NL, CLOSE, NL), num_words=2)  # a 64-token vocabulary


class OnlyToken:
    """A grammar that allows one token and counts what it consumed."""

    is_masking = True
    is_complete = False

    def __init__(self, token: int) -> None:
        self.token = token
        self.consumed: list[int] = []

    def consume(self, token_id: int) -> None:
        self.consumed.append(token_id)

    def fill(self, bits: np.ndarray) -> None:
        bits[:] = 0
        bits[self.token // 32] = 1 << (self.token % 32)


def allowed(constraint) -> list[int]:
    bits = np.zeros((1, constraint.num_words), dtype=np.int32)
    constraint.fill(bits[0])
    return np.flatnonzero(~refused_tokens(bits, 64, "cpu").numpy()[0]).tolist()


def test_a_budget_of_k_forces_the_closing_text_after_exactly_k_thinking_tokens():
    c = ThinkingConstraint(MARKERS, None, budget=3, starts_open=True)
    for token in (1, 2, 3):
        assert c.phase == THINKING and not c.is_masking
        c.consume(token)
    forced = []
    while c.phase == CLOSING:
        assert c.is_masking
        [token] = allowed(c)
        forced.append(token)
        c.consume(token)
    assert forced == [NL, CLOSE, NL] and c.phase == ANSWER and c.num_thinking == 3
    assert not c.is_masking and c.is_complete  # no grammar: the answer is free


def test_a_zero_budget_closes_at_once_and_a_model_that_closes_itself_is_not_forced():
    assert ThinkingConstraint(MARKERS, None, budget=0, starts_open=True).phase == CLOSING
    c = ThinkingConstraint(MARKERS, None, budget=10, starts_open=True)
    for token in (1, 2, CLOSE, 5):
        c.consume(token)
    assert (c.phase, c.num_thinking) == (ANSWER, 2)


def test_the_model_may_open_the_block_itself_or_answer_at_once():
    opened = ThinkingConstraint(MARKERS, None, budget=1, starts_open=False)
    assert opened.phase == BEFORE and not opened.is_masking
    opened.consume(OPEN)
    opened.consume(9)
    assert (opened.phase, opened.num_thinking, allowed(opened)) == (CLOSING, 1, [NL])
    answered = ThinkingConstraint(MARKERS, None, budget=1, starts_open=False)
    answered.consume(9)
    assert (answered.phase, answered.num_thinking) == (ANSWER, 0)


def test_the_grammar_constrains_the_answer_only():
    grammar = OnlyToken(12)
    c = ThinkingConstraint(MARKERS, grammar, budget=2, starts_open=True)
    for token in (1, 2, NL, CLOSE, NL):  # thinking, then the forced closing text
        c.consume(token)
    assert grammar.consumed == [] and c.phase == ANSWER and c.is_masking and allowed(c) == [12]
    c.consume(12)
    assert grammar.consumed == [12]
    # Not opened by the prompt, a grammar holds the answer from the first token (no thinking).
    assert ThinkingConstraint(MARKERS, OnlyToken(12), budget=None, starts_open=False).phase == ANSWER


class State:
    def __init__(self, constraint) -> None:
        self.constraint = constraint


def test_a_step_masks_only_the_rows_that_ask():
    free = ThinkingConstraint(MARKERS, None, budget=None, starts_open=True)
    forced = ThinkingConstraint(MARKERS, None, budget=0, starts_open=True)
    rows, refused = step_masks([State(None), State(free), State(forced)], 64, "cpu")
    assert rows == [2] and np.flatnonzero(~refused.numpy()[0]).tolist() == [NL]
    assert step_masks([State(free)], 64, "cpu") is None


class Countable(OnlyToken):
    """A grammar that forks as TokenConstraint does: its tokens up to a count."""

    def fork(self, num_tokens: int | None = None) -> "Countable":
        copy = Countable(self.token)
        copy.consumed = list(self.consumed if num_tokens is None else self.consumed[:num_tokens])
        return copy


def test_a_fork_keeps_the_phase_budget_and_grammar_of_its_tokens():
    c = ThinkingConstraint(MARKERS, Countable(12), budget=2, starts_open=True)
    for token in (1, 2, NL, CLOSE, NL, 12, 12):
        c.consume(token)
    mid_thought = c.fork(1)
    assert (mid_thought.phase, mid_thought.num_thinking, mid_thought.inner.consumed) == (THINKING, 1, [])
    mid_thought.consume(9)
    assert (mid_thought.phase, allowed(mid_thought)) == (CLOSING, [NL])  # its own budget, as the parent's
    closing = c.fork(3)
    assert (closing.phase, allowed(closing)) == (CLOSING, [CLOSE])
    answering = c.fork(6)
    assert (answering.phase, answering.inner.consumed, answering.is_masking) == (ANSWER, [12], True)
    whole = c.fork()
    assert (whole.num_consumed, whole.num_thinking, whole.inner.consumed) == (7, 2, [12, 12])
    assert c.inner.consumed == [12, 12]  # the parent is untouched


def test_markers_need_each_tag_to_be_one_token_of_its_own(tmp_path):
    from tests.conftest import build_tokenizer

    word_level = build_tokenizer(tmp_path)  # no `<think>` in its vocabulary: it would encode as `<unk>`
    assert ThinkingMarkers.of(word_level, "think", 2) is None
    assert ThinkingMarkers.of(word_level, "none", 2) is None
