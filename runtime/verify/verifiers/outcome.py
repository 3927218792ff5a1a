"""Outcome reward model: any `AutoModelForSequenceClassification` that rates a whole answer.

Input: the chat template over user = question, assistant = the steps joined by `step_separator`
(default the reference delimiter "\\n\\n"); a tokenizer without a chat template gets the pair
encoding `tokenizer(question, answer)` (what encoder reward models were trained on; token type
ids are not passed, which suits decoder reward models and DeBERTa-v3, whose configs use none).
Read-out: the model's own pooled logits (the last non-pad token for decoders, [CLS] for encoders):
with one label sigmoid(logit), with two labels softmax P(index 1).

ONE score per path, not one per step: `score` returns `[s]` for every non-empty path. Any
aggregation of a one-element list is that element, so `last`/`min`/`prod`/`mean` all give `s`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from runtime.verify.verifiers.base import UNUSED_LM_HEAD, ScoringInput, Verifier, length_batches, pad_right


class OutcomeVerifier(Verifier):
    kind = "orm"
    is_outcome = True
    auto_class = "AutoModelForSequenceClassification"
    ignorable_keys = (UNUSED_LM_HEAD,)

    def __init__(self, model: Any, tokenizer: Any, *, step_separator: str = "\n\n",
                 batch_size: int = 8) -> None:
        super().__init__(model, tokenizer, batch_size=batch_size)
        self.num_labels = model.config.num_labels
        if self.num_labels not in (1, 2):
            raise ValueError(f"an outcome reward model needs 1 or 2 labels, this one has {self.num_labels}")
        self.step_separator = step_separator
        # Sequence classifiers pool at the last token that is not the config's pad token; padding
        # with that token keeps batching exact. Without one, sequences run one at a time.
        self.config_pad_token_id = model.config.get_text_config().pad_token_id

    def build_inputs(self, question: str, steps: Sequence[str]) -> list[ScoringInput]:
        if not steps:
            return []
        answer = self.step_separator.join(step.strip() for step in steps)
        if self.has_chat_template:
            text = self.render_chat([{"role": "user", "content": question.strip()},
                                     {"role": "assistant", "content": answer}], add_generation_prompt=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(question.strip(), answer)["input_ids"]
        # Nominal: the classifier pools by itself; the last token is where a decoder reads.
        return [ScoringInput(tuple(ids), (len(ids) - 1,))]

    def run(self, inputs: Sequence[ScoringInput]) -> list[list[float]]:
        results: list[list[float]] = [[] for _ in inputs]
        batch_size = self.batch_size if self.config_pad_token_id is not None else 1
        pad = self.config_pad_token_id if self.config_pad_token_id is not None else self.pad_token_id
        for batch in length_batches(inputs, batch_size):
            input_ids, attention_mask = pad_right([inputs[i].token_ids for i in batch], pad, self.device)
            with torch.inference_mode():
                logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
                scores = self.read_scores(logits).tolist()
            for i, score in zip(batch, scores):
                results[i] = [score]
        return results

    def read_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Here the rows are the model's pooled logits [k, num_labels], not hidden states."""
        logits = hidden.float()
        if self.num_labels == 1:
            return torch.sigmoid(logits[:, 0])
        return logits.softmax(dim=-1)[:, 1]
