"""The published Qwen2.5-Math-PRM checkpoint layout, loaded without remote code.

`Qwen/Qwen2.5-Math-PRM-7B` (and `-72B`) declare `architectures: ["Qwen2ForProcessRewardModel"]` and
ship their class as remote code: a Qwen2 body under `model.*` and a two-layer head
`score = Sequential(Linear(h, h), ReLU, Linear(h, 2))`, keys `score.0.{weight,bias}` and
`score.2.{weight,bias}`, and no LM head (the layout vLLM's and SGLang's `Qwen2ForProcessRewardModel`
read). transformers' own `Qwen2ForTokenClassification` has a one-layer `score`, so loading the
checkpoint through it would drop the published head; this class reads it as published.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import TokenClassifierOutput
from transformers.models.qwen2.modeling_qwen2 import Qwen2Model, Qwen2PreTrainedModel

ARCHITECTURE = "Qwen2ForProcessRewardModel"
NUM_LABELS = 2  # the head's two classes: index 1 is "this step is correct"


class Qwen2ProcessRewardModel(Qwen2PreTrainedModel):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.model = Qwen2Model(config)
        hidden = config.hidden_size
        self.score = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, NUM_LABELS))
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                **kwargs) -> TokenClassifierOutput:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        return TokenClassifierOutput(logits=self.score(hidden))
