"""LLM as judge: any causal chat model (the generator itself, or another) asked whether the latest
step of a partial solution is correct, answering Yes or No.

Input: one sequence PER STEP k: the chat template (with the generation prompt) over one user turn
holding the problem, steps 1..k and the question "Is step k correct?". Read-out: the next-token
logits at the last position; score = P(Yes) / (P(Yes) + P(No)).

Which tokens are "Yes" and "No": the first token of each spelling in `YES_SPELLINGS` / `NO_SPELLINGS`
("Yes" and " Yes", "No" and " No"), since a reply may start right after the generation prompt or
after a space. P(Yes) sums the distinct first tokens of the Yes spellings (likewise for No); a first
token shared by a Yes and a No spelling (a bare "▁" or "Ġ") says nothing and is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from runtime.verify.verifiers.base import ScoringInput, Verifier

YES_SPELLINGS = ("Yes", " Yes")
NO_SPELLINGS = ("No", " No")

DEFAULT_PROMPT = (
    "Here is a problem and the first steps of a solution.\n\n"
    "Problem:\n{question}\n\n"
    "Solution so far:\n{steps}\n\n"
    "Is step {k} correct? Answer with Yes or No only."
)


class JudgeVerifier(Verifier):
    kind = "judge"

    def __init__(self, model: Any, tokenizer: Any, *, prompt: str = DEFAULT_PROMPT,
                 batch_size: int = 8) -> None:
        super().__init__(model, tokenizer, batch_size=batch_size)
        self.prompt = prompt
        yes = {self._first_token_id(s) for s in YES_SPELLINGS}
        no = {self._first_token_id(s) for s in NO_SPELLINGS}
        self.yes_token_ids, self.no_token_ids = tuple(sorted(yes - no)), tuple(sorted(no - yes))
        if not self.yes_token_ids or not self.no_token_ids:
            raise ValueError("this tokenizer has no distinct first tokens for Yes and No")

    def _first_token_id(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ValueError(f"the tokenizer encodes {text!r} to no tokens")
        return ids[0]

    def build_text(self, question: str, steps: Sequence[str], k: int) -> str:
        """The text asking about step k (1-based), steps 1..k shown."""
        shown = "\n\n".join(f"Step {i}: {step.strip()}" for i, step in enumerate(steps[:k], start=1))
        content = self.prompt.format(question=question.strip(), steps=shown, k=k)
        if self.has_chat_template:
            return self.render_chat([{"role": "user", "content": content}], add_generation_prompt=True)
        return content + "\nAnswer:"

    def build_inputs(self, question: str, steps: Sequence[str]) -> list[ScoringInput]:
        return [self.build_input(question, steps, k) for k in range(1, len(steps) + 1)]

    def build_input(self, question: str, steps: Sequence[str], k: int) -> ScoringInput:
        """The question about step k alone (a search asks only about its paths' newest step)."""
        text = self.build_text(question, steps, k)
        # A rendered template carries its own special tokens; a plain prompt gets the BOS.
        ids = self.tokenizer(text, add_special_tokens=not self.has_chat_template)["input_ids"]
        return ScoringInput(tuple(ids), (len(ids) - 1,))

    def read_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_logits(hidden, self.yes_token_ids + self.no_token_ids)
        yes, no = logits.split([len(self.yes_token_ids), len(self.no_token_ids)], dim=-1)
        return torch.sigmoid(yes.logsumexp(dim=-1) - no.logsumexp(dim=-1))
