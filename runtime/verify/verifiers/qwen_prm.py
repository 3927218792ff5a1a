"""Qwen2.5-Math-PRM (`Qwen/Qwen2.5-Math-PRM-7B`, `-72B`): a Qwen2 body with a per-token 2-way
classification head (`model.score`), trained on steps separated by the `<extra_0>` token.

Input: the chat template over system, user = question, assistant = the steps joined by `<extra_0>`
and ending with `<extra_0>`. Read-out: the head's two logits at each `<extra_0>`, softmax,
score = P(index 1) (the "correct" class).

The published checkpoint (`Qwen2ForProcessRewardModel`: a two-layer `score` head) loads without
remote code into runtime.verify.verifiers.qwen_prm_model, or with `trust_remote_code` through
`AutoModel` as its model card does; any model with `.base_model` and a `.score` head mapping hidden
states to 2 logits works, e.g. a checkpoint saved from `Qwen2ForTokenClassification(num_labels=2)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from runtime.verify.verifiers.base import UNUSED_LM_HEAD, ScoringInput, Verifier, tokenize_marked

DEFAULT_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."


class QwenPRMVerifier(Verifier):
    kind = "qwen-prm"
    auto_class = "AutoModelForTokenClassification"
    ignorable_keys = (UNUSED_LM_HEAD,)

    def __init__(self, model: Any, tokenizer: Any, *, step_token: str = "<extra_0>",
                 system_prompt: str = DEFAULT_SYSTEM_PROMPT, batch_size: int = 8) -> None:
        super().__init__(model, tokenizer, batch_size=batch_size)
        if not self.has_chat_template:
            raise ValueError("the Qwen PRM verifier needs a tokenizer with a chat template")
        head = getattr(model, "score", None)
        if head is None:
            raise ValueError("the Qwen PRM verifier needs a model with a `score` head (2 labels)")
        self.head = head
        self.step_token = step_token
        self.system_prompt = system_prompt

    def build_text(self, question: str, steps: Sequence[str]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character span of each step token."""
        answer = "".join(step.strip() + self.step_token for step in steps)
        messages = [{"role": "system", "content": self.system_prompt},
                    {"role": "user", "content": question.strip()},
                    {"role": "assistant", "content": answer}]
        text = self.render_chat(messages, add_generation_prompt=False)
        start = text.rfind(answer)  # the assistant turn is the last to hold the answer
        if start < 0:
            raise ValueError("the chat template altered the assistant's steps")
        marks = []
        for step in steps:
            start += len(step.strip())
            marks.append((start, start + len(self.step_token)))
            start += len(self.step_token)
        return text, marks

    def build_inputs(self, question: str, steps: Sequence[str]) -> list[ScoringInput]:
        if not steps:
            return []
        text, marks = self.build_text(question, steps)
        ids, positions = tokenize_marked(self.tokenizer, text, marks, add_special_tokens=False)
        return [ScoringInput(ids, positions)]

    def read_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float().softmax(dim=-1)[:, 1]
