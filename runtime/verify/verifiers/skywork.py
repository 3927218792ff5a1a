"""Skywork-o1-Open-PRM (`Skywork/Skywork-o1-Open-PRM-Qwen-2.5-1.5B`, `-7B`): a Qwen2.5 causal LM body
with a value head `Linear(hidden, 1)` on its last hidden state.

Input (no chat template, the reference's `prepare_input`): `bos + question + "\\n"` tokenised, then
for each step its own tokens followed by the step token (`"\\n"`). Read-out: sigmoid of the value
head at each step token.

Expected checkpoint layout (what Skywork publishes): one directory with a causal LM checkpoint
(`config.json`, tokenizer files, `*.safetensors`) whose safetensors files ALSO hold the value head as
`v_head.summary.weight` [1, hidden] and `v_head.summary.bias` [1] (the layout of trl's
`AutoModelForCausalLMWithValueHead`). `value_head.weight` / `value_head.bias` are accepted as well,
in any `*.safetensors` file of the directory, e.g. a separate `value_head.safetensors`.
`AutoModelForCausalLM` loads the body and ignores the head's keys; `load_value_head` reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from runtime.model.loader import Ignorable
from runtime.verify.verifiers.base import ScoringInput, Verifier

VALUE_HEAD_PREFIXES = ("v_head.summary.", "value_head.")


def load_value_head(directory: str | Path) -> torch.nn.Linear:
    """The value head stored next to a causal LM in `directory`'s safetensors files."""
    from safetensors import safe_open

    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as tensors:
            keys = set(tensors.keys())
            for prefix in VALUE_HEAD_PREFIXES:
                if prefix + "weight" not in keys:
                    continue
                weight = tensors.get_tensor(prefix + "weight")
                bias = tensors.get_tensor(prefix + "bias") if prefix + "bias" in keys else None
                if weight.dim() != 2 or weight.shape[0] != 1:
                    raise ValueError(f"{path}: {prefix}weight has shape {tuple(weight.shape)}, "
                                     "expected [1, hidden]")
                head = torch.nn.Linear(weight.shape[1], 1, bias=bias is not None, dtype=weight.dtype)
                with torch.no_grad():
                    head.weight.copy_(weight)
                    if bias is not None:
                        head.bias.copy_(bias.reshape(1))
                return head.eval()
    raise FileNotFoundError(f"no value head ({', '.join(p + 'weight' for p in VALUE_HEAD_PREFIXES)}) "
                            f"in the safetensors files of {directory}")


class SkyworkPRMVerifier(Verifier):
    kind = "skywork"
    ignorable_keys = (Ignorable("unexpected", r"^(v_head\.summary|value_head)\.(weight|bias)$",
                                "the value head, which `load_value_head` reads beside the causal LM body"),)

    def __init__(self, model: Any, tokenizer: Any, *, value_head: torch.nn.Linear | None = None,
                 step_token: str = "\n", batch_size: int = 8) -> None:
        super().__init__(model, tokenizer, batch_size=batch_size)
        if value_head is None:
            # A model loaded with from_pretrained remembers its directory; the head lives there too.
            value_head = load_value_head(model.name_or_path)
        parameter = next(model.parameters())
        self.value_head = value_head.to(device=parameter.device, dtype=parameter.dtype).eval()
        self.step_token_id = self.last_token_id(step_token)

    def build_inputs(self, question: str, steps: Sequence[str]) -> list[ScoringInput]:
        if not steps:
            return []
        encode = self.tokenizer.encode
        bos = self.tokenizer.bos_token_id
        ids = ([bos] if bos is not None else []) + encode(question + "\n", add_special_tokens=False)
        positions = []
        for step in steps:
            step = step.strip()
            if step:
                ids += encode(step, add_special_tokens=False)
            ids.append(self.step_token_id)
            positions.append(len(ids) - 1)
        return [ScoringInput(tuple(ids), tuple(positions))]

    def read_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.value_head(hidden).float().squeeze(-1))
