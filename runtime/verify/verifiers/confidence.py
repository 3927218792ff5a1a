"""Self-confidence: the generator scores its own steps, no extra model.

Input: the generator's prompt (the chat template over user = question, with the generation prompt;
without a template the question and a newline) followed by the steps joined by `step_separator`.
Read-out: for each step, the mean log-probability of its tokens under the model (temperature 1, the
raw distribution, not the sampling one), reported as exp(mean) in [0, 1], the per-token geometric
mean probability. A token belongs to the step whose characters it overlaps first; separator-only
tokens belong to no step. An empty step scores 1.0 (the probability of an empty sequence).

An engine that kept the sampled tokens' log-probs can skip the forward pass and call
`confidence_from_logprobs` on them directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runtime.verify.verifiers.base import ScoringInput, Verifier, gather_index, length_batches, pad_right


def confidence_from_logprobs(logprobs: Sequence[float]) -> float:
    """exp(mean log-probability) of one step's tokens; 1.0 for no tokens."""
    if not logprobs:
        return 1.0
    return math.exp(math.fsum(logprobs) / len(logprobs))


@dataclass(frozen=True)
class StepTokensInput(ScoringInput):
    """A ScoringInput whose read positions are every position that predicts a step token (token
    index - 1), `tokens_per_step[i]` of them for step i, in order."""

    tokens_per_step: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if sum(self.tokens_per_step) != len(self.read_positions):
            raise ValueError("tokens_per_step does not add up to the read positions")


class ConfidenceVerifier(Verifier):
    kind = "confidence"

    def __init__(self, model: Any, tokenizer: Any, *, step_separator: str = "\n\n",
                 batch_size: int = 8) -> None:
        super().__init__(model, tokenizer, batch_size=batch_size)
        self.step_separator = step_separator

    def build_text(self, question: str, steps: Sequence[str]) -> tuple[str, list[tuple[int, int]]]:
        """The prompt and answer text, and the character span of each step in it."""
        if self.has_chat_template:
            text = self.render_chat([{"role": "user", "content": question}], add_generation_prompt=True)
        else:
            text = question + "\n"
        spans = []
        for i, step in enumerate(steps):
            if i:
                text += self.step_separator
            spans.append((len(text), len(text) + len(step)))
            text += step
        return text, spans

    def build_inputs(self, question: str, steps: Sequence[str]) -> list[ScoringInput]:
        if not steps:
            return []
        text, spans = self.build_text(question, steps)
        encoding = self.tokenizer(text, add_special_tokens=not self.has_chat_template,
                                  return_offsets_mapping=True)
        ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
        per_step: list[list[int]] = [[] for _ in steps]
        step = 0
        for index in range(1, len(ids)):  # token 0 has no prediction
            token_start, token_end = offsets[index]
            if token_end <= token_start:
                continue  # special tokens: no characters
            while step < len(spans) and spans[step][1] <= token_start:
                step += 1  # that step ends before this token (an empty step always does)
            if step < len(spans) and _overlaps(spans[step], offsets[index]):
                per_step[step].append(index - 1)
        return [StepTokensInput(tuple(ids), tuple(p for ps in per_step for p in ps),
                                tuple(len(ps) for ps in per_step))]

    def run(self, inputs: Sequence[ScoringInput]) -> list[list[float]]:
        """`inputs`: this verifier's own (`build_inputs`), each counting its steps' tokens; a step with
        none (an input with no read positions is in no batch) scores 1.0."""
        results: list[list[float]] = [[1.0] * len(x.tokens_per_step) for x in inputs]
        for batch in length_batches(inputs, self.batch_size):
            input_ids, attention_mask = pad_right([inputs[i].token_ids for i in batch],
                                                  self.pad_token_id, self.device)
            rows, cols = gather_index([inputs[i].read_positions for i in batch], self.device)
            with torch.inference_mode():
                hidden = self.model.base_model(input_ids=input_ids,
                                               attention_mask=attention_mask).last_hidden_state
                logprobs = self.token_logprobs(hidden[rows, cols], input_ids[rows, cols + 1]).tolist()
            offset = 0
            for i in batch:
                scores = []
                for count in inputs[i].tokens_per_step:
                    scores.append(confidence_from_logprobs(logprobs[offset:offset + count]))
                    offset += count
                results[i] = scores
        return results

    def token_logprobs(self, hidden: torch.Tensor, next_token_ids: torch.Tensor) -> torch.Tensor:
        """[k, hidden] states and the [k] tokens that follow them -> [k] log-probabilities."""
        logprobs = self.lm_logits(hidden).log_softmax(dim=-1)
        return logprobs.gather(-1, next_token_ids.unsqueeze(-1)).squeeze(-1)

    def read_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Not a per-row read-out: a step's score needs the tokens that follow its rows (see `run`)."""
        raise NotImplementedError("confidence scores come from token log-probs; use run()")


def _overlaps(span: tuple[int, int], token: tuple[int, int]) -> bool:
    return token[0] < span[1] and token[1] > span[0]
