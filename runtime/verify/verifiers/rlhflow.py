"""RLHFlow PRMs (`RLHFlow/Llama3.1-8B-PRM-Mistral-Data`, `...-Deepseek-Data`): a chat model trained
to answer every step with an assistant turn `+` (good) or `-` (bad).

Input: the chat template over turns user = question + " " + step_1, assistant = "+", user = step_2,
assistant = "+", ... Read-out: the logits that PREDICT each assistant `+` (the position before it),
softmax over `+` and `-`, score = P(`+`). For Llama 3.1 this is the model card's `logits[:, -3]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from runtime.verify.verifiers.base import ScoringInput, Verifier, tokenize_marked


class RLHFlowVerifier(Verifier):
    kind = "rlhflow"

    def __init__(self, model: Any, tokenizer: Any, *, good_token: str = "+", bad_token: str = "-",
                 batch_size: int = 8) -> None:
        super().__init__(model, tokenizer, batch_size=batch_size)
        if not self.has_chat_template:
            raise ValueError("the RLHFlow verifier needs a tokenizer with a chat template")
        self.good_token = good_token
        self.label_token_ids = (self.last_token_id(good_token), self.last_token_id(bad_token))
        if self.label_token_ids[0] == self.label_token_ids[1]:
            raise ValueError(f"{good_token!r} and {bad_token!r} share a token in this tokenizer")

    def conversation(self, question: str, steps: Sequence[str]) -> list[dict[str, str]]:
        turns = []
        for i, step in enumerate(steps):
            content = f"{question.strip()} {step.strip()}" if i == 0 else step.strip()
            turns.append({"role": "user", "content": content})
            turns.append({"role": "assistant", "content": self.good_token})
        return turns

    def build_text(self, question: str, steps: Sequence[str]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character span of each assistant `+`.

        Each span is the first `+` after the rendering of the conversation up to that step's user
        turn, so a `+` inside a step's own text is never taken for a label.
        """
        turns = self.conversation(question, steps)
        text = self.render_chat(turns, add_generation_prompt=False)
        marks = []
        for k in range(len(steps)):
            before = self.render_chat(turns[:2 * k + 1], add_generation_prompt=False)
            if not text.startswith(before):
                raise ValueError("the chat template does not render conversations prefix-stably")
            start = text.find(self.good_token, len(before))
            if start < 0:
                raise ValueError("the chat template dropped the assistant label")
            marks.append((start, start + len(self.good_token)))
        return text, marks

    def build_inputs(self, question: str, steps: Sequence[str]) -> list[ScoringInput]:
        if not steps:
            return []
        text, marks = self.build_text(question, steps)
        ids, label_positions = tokenize_marked(self.tokenizer, text, marks, add_special_tokens=False)
        return [ScoringInput(ids, tuple(p - 1 for p in label_positions))]

    def read_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_logits(hidden, self.label_token_ids).softmax(dim=-1)[:, 0]
