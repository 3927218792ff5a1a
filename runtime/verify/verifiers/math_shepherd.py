"""Math-Shepherd (`peiyi9979/math-shepherd-mistral-7b-prm`): a causal LM trained to replace a step
tag with `+` (good step) or `-` (bad step).

Input: `question + " " + step_1 + " ки" + "\\n" + step_2 + " ки" ...` (the model card's layout),
tokenised as one text with the tokenizer's special tokens (BOS). Read-out: the LM logits AT each tag
token, softmax over the two label tokens, score = P(`+`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from runtime.verify.verifiers.base import ScoringInput, Verifier, tokenize_marked


class MathShepherdVerifier(Verifier):
    kind = "math-shepherd"

    def __init__(self, model: Any, tokenizer: Any, *, step_tag: str = "ки", good_token: str = "+",
                 bad_token: str = "-", step_separator: str = "\n", batch_size: int = 8) -> None:
        super().__init__(model, tokenizer, batch_size=batch_size)
        self.step_tag = step_tag
        self.step_separator = step_separator
        # The labels as they stand in training text, in place of a space-prefixed tag.
        self.label_token_ids = (self.last_token_id(f"{step_tag} {good_token}"),
                                self.last_token_id(f"{step_tag} {bad_token}"))
        if self.label_token_ids[0] == self.label_token_ids[1]:
            raise ValueError(f"{good_token!r} and {bad_token!r} share a token in this tokenizer")

    def build_text(self, question: str, steps: Sequence[str]) -> tuple[str, list[tuple[int, int]]]:
        """The verifier text and the character span of each step's tag in it."""
        text = question.strip() + " "
        marks = []
        for i, step in enumerate(steps):
            if i:
                text += self.step_separator
            text += step.strip()
            start = len(text)  # the span holds the space: most tokenizers fold it into the tag token
            text += " " + self.step_tag
            marks.append((start, len(text)))
        return text, marks

    def build_inputs(self, question: str, steps: Sequence[str]) -> list[ScoringInput]:
        if not steps:
            return []
        text, marks = self.build_text(question, steps)
        ids, positions = tokenize_marked(self.tokenizer, text, marks, add_special_tokens=True)
        return [ScoringInput(ids, positions)]

    def read_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_logits(hidden, self.label_token_ids).softmax(dim=-1)[:, 0]
