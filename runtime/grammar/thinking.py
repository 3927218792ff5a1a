"""A thinking model's output as a sequence of phases, held per sequence like a grammar's place: before any
thinking, thinking, the closing text being forced, and the answer.

`ThinkingConstraint` takes the place of a sequence's grammar constraint (`SamplingState.constraint`), and
forks and rolls back with it (a search path's): it counts
the thinking tokens (usage.completion_tokens_details.reasoning_tokens), forces the family's closing text
once a thinking budget is spent (thinking_token_budget, reasoning_effort), and hands the answer to the
request's grammar (response_format, tools), which so constrains the answer only: thinking is free text.
While nothing is forced or constrained it asks for no mask (`is_masking`), so a row costs nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.grammar.matcher import TokenConstraint
from runtime.wire.reasoning import CLOSE, OPEN

BEFORE, THINKING, CLOSING, ANSWER = "before", "thinking", "closing", "answer"
CLOSING_TEXT = {"think": "\n" + CLOSE + "\n\n"}  # what a budget forces: the templates' own closing


@dataclass(frozen=True)
class ThinkingMarkers:
    """A model's thinking tags as token ids: each tag one token, as in every `think` family's vocabulary."""

    open_id: int
    close_id: int
    closing_ids: tuple[int, ...]  # the closing text a budget forces
    num_words: int  # the mask's int32 words, as its grammars' (runtime.grammar.compiler)

    @classmethod
    def of(cls, tokenizer, fmt: str, num_words: int) -> "ThinkingMarkers | None":
        """None where the model does not think in its text, or a tag is not one token."""
        if fmt not in CLOSING_TEXT:
            return None
        ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (OPEN, CLOSE)]
        if any(len(tag_ids) != 1 or tokenizer.decode(tag_ids) != tag for tag, tag_ids in zip((OPEN, CLOSE), ids)):
            return None
        closing = tuple(tokenizer.encode(CLOSING_TEXT[fmt], add_special_tokens=False))
        return cls(ids[0][0], ids[1][0], closing, num_words)


@dataclass(frozen=True)
class ThinkingStart:
    """How a request's outputs begin on a thinking model: its format, whether the prompt opened the block,
    and the tags as tokens (None where they are not one token each: the text is still told apart, but no
    budget is held and a grammar holds the whole output)."""

    fmt: str
    starts_open: bool
    markers: ThinkingMarkers | None

    def constraint(self, inner: TokenConstraint | None, budget: int | None):
        """A new sequence's constraint: its phases around `inner` (the request's grammar, or None)."""
        if self.markers is None:
            return inner
        return ThinkingConstraint(self.markers, inner, budget, self.starts_open)


class ThinkingConstraint:
    def __init__(self, markers: ThinkingMarkers, inner: TokenConstraint | None, budget: int | None,
                 starts_open: bool, has_grammar: bool | None = None) -> None:
        """`inner`: the request's grammar, for the answer; `budget`: the most thinking tokens, or None;
        `starts_open`: the prompt opened the thinking block (else the model may open it first thing,
        unless a grammar holds the answer from its first token)."""
        self.markers = markers
        self.inner = inner
        self.budget = budget
        self.starts_open = starts_open
        self.has_grammar = inner is not None if has_grammar is None else has_grammar
        self.num_words = markers.num_words
        self.num_thinking = 0  # thinking tokens sampled, the closing text not counted
        self.num_consumed = 0
        self.tokens: list[int] = []  # every token consumed, to fork at any of them
        self.forced: list[int] = []  # the closing text's ids still to come, in reverse
        self.phase = THINKING if starts_open else ANSWER if self.has_grammar else BEFORE
        if self.phase == THINKING:
            self._check_budget()

    def fork(self, num_tokens: int | None = None) -> "ThinkingConstraint":
        """A copy that has consumed only the first `num_tokens` of this one's tokens (all: None), its
        grammar forked at as many of them as were the answer's."""
        kept = self.tokens if num_tokens is None else self.tokens[:num_tokens]
        copy = ThinkingConstraint(self.markers, None, self.budget, self.starts_open, self.has_grammar)
        num_answer = 0
        for token in kept:
            num_answer += copy.phase == ANSWER
            copy.consume(token)
        if self.inner is not None:
            copy.inner = self.inner.fork(num_answer)
        return copy

    def _check_budget(self) -> None:
        if self.budget is not None and self.num_thinking >= self.budget:
            self.phase = CLOSING
            self.forced = list(reversed(self.markers.closing_ids))

    @property
    def is_masking(self) -> bool:
        return self.phase == CLOSING or (self.phase == ANSWER and self.has_grammar)

    @property
    def is_complete(self) -> bool:
        return self.phase == ANSWER and (not self.has_grammar or self.inner.is_complete)

    def consume(self, token_id: int) -> None:
        self.num_consumed += 1
        self.tokens.append(token_id)
        if self.phase == BEFORE:
            self.phase = THINKING if token_id == self.markers.open_id else ANSWER
            if self.phase == THINKING:
                self._check_budget()
        elif self.phase == THINKING:
            if token_id == self.markers.close_id:
                self.phase = ANSWER
            else:
                self.num_thinking += 1
                self._check_budget()
        elif self.phase == CLOSING:
            self.forced.pop()
            if not self.forced:
                self.phase = ANSWER
        elif self.inner is not None:
            self.inner.consume(token_id)

    def fill(self, bits: np.ndarray) -> None:
        """The allowed next tokens (only asked for while `is_masking`): the next forced token, or the grammar's."""
        if self.phase == CLOSING:
            bits[:] = 0
            token = self.forced[-1]
            bits[token // 32] = np.int32(np.uint32(1 << (token % 32)).view(np.int32))
            return
        assert self.inner is not None
        self.inner.fill(bits)
