"""A sequence's place in its grammar, and the masks a step's constrained rows sample under.

A `TokenConstraint` belongs to one sequence's sampling state: it consumes each token the sequence
samples, a fork copies it at the fork point (rolling back the parent's tokens past it: a search path's
speculative ones), so a child continues exactly where its tokens are. The sampler is handed only
`allowed`, a boolean [rows, vocab] tensor.
"""

from __future__ import annotations

import numpy as np
import torch
from llguidance import LLMatcher


class TokenConstraint:
    def __init__(self, matcher: LLMatcher, num_words: int) -> None:
        self.matcher = matcher
        self.num_words = num_words  # the mask's int32 words: llguidance's vocabulary, at least the model's
        self.num_consumed = 0

    @classmethod
    def start(cls, compiled: LLMatcher, num_words: int) -> "TokenConstraint":
        """A fresh constraint from a compiled grammar (which stays pristine)."""
        return cls(compiled.deep_copy(), num_words)

    def fork(self, num_tokens: int | None = None) -> "TokenConstraint":
        """A copy that has consumed only the first `num_tokens` of this one's tokens (all: None)."""
        copy = TokenConstraint(self.matcher.deep_copy(), self.num_words)
        copy.num_consumed = self.num_consumed
        if num_tokens is not None and num_tokens < self.num_consumed:
            copy.matcher.rollback(self.num_consumed - num_tokens)
            copy.num_consumed = num_tokens
        return copy

    def consume(self, token_id: int) -> None:
        """The sequence sampled `token_id` (allowed by the mask, so the matcher accepts it; EOS past the
        grammar's end leaves the matcher stopped, where it allows only EOS)."""
        self.matcher.consume_token(token_id)
        self.num_consumed += 1

    is_masking = True  # every token it allows is asked of it (a thinking phase may ask for none)

    @property
    def is_complete(self) -> bool:
        """The output so far is a whole match of the grammar."""
        return self.matcher.is_accepting()

    def fill(self, bits: np.ndarray) -> None:
        """Write the allowed next tokens as little-endian bits into `bits` (int32, one row)."""
        self.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)


def step_masks(states, vocab_size: int, device) -> tuple[list[int], torch.Tensor] | None:
    """The `refused` argument of `runtime.model.sampler.sample` for a step's sampling states: the rows
    with a constraint and the tokens their grammars refuse, or None when no row has one."""
    rows = [i for i, state in enumerate(states) if state.constraint is not None and state.constraint.is_masking]
    if not rows:
        return None
    bits = np.zeros((len(rows), states[rows[0]].constraint.num_words), dtype=np.int32)
    for k, row in enumerate(rows):
        states[row].constraint.fill(bits[k])
    return rows, refused_tokens(bits, vocab_size, device)


def advance(states, samples) -> None:
    """Each constrained row consumes the token it sampled."""
    for state, out in zip(states, samples):
        if state.constraint is not None:
            state.constraint.consume(out.token_id)


def allowed_tokens(constraints: list[TokenConstraint], vocab_size: int, device) -> torch.Tensor:
    """[len(constraints), vocab_size] booleans: True where the row's grammar allows the token."""
    bits = np.zeros((len(constraints), constraints[0].num_words), dtype=np.int32)
    for row, constraint in enumerate(constraints):
        constraint.fill(bits[row])
    return ~refused_tokens(bits, vocab_size, device)


def refused_tokens(bits: np.ndarray, vocab_size: int, device) -> torch.Tensor:
    """The complement of the masks `bits` hold, unpacked without a copy beyond the one unpacking makes."""
    unpacked = np.unpackbits((~bits).view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(unpacked.view(np.bool_)).to(device)


class Grammar:
    """A compiled grammar as requests hold it: each of their sequences starts a constraint from it."""

    def __init__(self, compiled: LLMatcher, num_words: int) -> None:
        self.compiled = compiled
        self.num_words = num_words

    def start(self) -> TokenConstraint:
        return TokenConstraint.start(self.compiled, self.num_words)
