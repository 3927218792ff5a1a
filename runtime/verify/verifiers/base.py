"""What every verifier adapter shares.

A verifier turns (question, the steps of one path) into one score in [0, 1] per step. Each family is
split in two halves so a faster runner (paged KV, prefix cache) can reuse the first and the last:

1. `build_inputs(question, steps)`: the token ids of the sequence(s) to run and, in each, the
   positions whose model outputs score a step. Pure tokenisation, no torch.
2. `run(inputs)`: a plain transformers forward pass over right-padded batches (this module), which
   gathers the final hidden states at the read positions and hands them to
3. `read_scores(hidden)`: the family's head on those rows (LM head + softmax, value head + sigmoid...).

Right padding never changes a causal model's outputs at real positions, so a padded batch scores
exactly as each sequence alone would.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from runtime.model.loader import Ignorable


@dataclass(frozen=True)
class ScoringInput:
    """One verifier sequence: its token ids and the positions whose outputs give step scores."""

    token_ids: tuple[int, ...]
    read_positions: tuple[int, ...]  # ascending; each < len(token_ids)

    def __post_init__(self) -> None:
        if any(not 0 <= p < len(self.token_ids) for p in self.read_positions):
            raise ValueError(f"read positions {self.read_positions} outside {len(self.token_ids)} tokens")


class Verifier(ABC):
    """Scores paths with a loaded transformers model and its tokenizer (inference only)."""

    kind: ClassVar[str]
    # True for a verifier that gives one score per path instead of one per step.
    is_outcome: ClassVar[bool] = False
    # Which Auto class loads this family's checkpoint (see registry.load_verifier).
    auto_class: ClassVar[str] = "AutoModelForCausalLM"
    # Checkpoint keys this family may lack or hold unread, each with its reason (runtime.model.loader).
    ignorable_keys: ClassVar[tuple[Ignorable, ...]] = ()

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 8) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = pad if pad is not None else 0

    # -- the two halves ------------------------------------------------------------------------

    @abstractmethod
    def build_inputs(self, question: str, steps: Sequence[str]) -> list[ScoringInput]:
        """The sequences to run for one path; their read positions, in order, give one score per
        step (one score in all for an outcome verifier)."""

    @abstractmethod
    def read_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """[k, hidden] final hidden states at read positions -> [k] scores in [0, 1]."""

    # -- running -------------------------------------------------------------------------------

    def score(self, question: str, steps: Sequence[Sequence[str]]) -> list[list[float]]:
        """Per path (a list of step texts, trailing delimiters already stripped), one score per step."""
        inputs_per_path = [self.build_inputs(question, list(path)) for path in steps]
        flat_scores = iter(self.run([item for inputs in inputs_per_path for item in inputs]))
        results = []
        for path, inputs in zip(steps, inputs_per_path):
            scores = [s for _ in inputs for s in next(flat_scores)]
            expected = min(len(path), 1) if self.is_outcome else len(path)
            assert len(scores) == expected, (self.kind, len(scores), expected)
            results.append(scores)
        return results

    def run(self, inputs: Sequence[ScoringInput]) -> list[list[float]]:
        """Scores at the read positions of each input, forwarding right-padded batches."""
        results: list[list[float]] = [[] for _ in inputs]
        for batch in length_batches(inputs, self.batch_size):
            input_ids, attention_mask = pad_right([inputs[i].token_ids for i in batch],
                                                  self.pad_token_id, self.device)
            rows, cols = gather_index([inputs[i].read_positions for i in batch], self.device)
            with torch.inference_mode():
                hidden = self.model.base_model(input_ids=input_ids,
                                               attention_mask=attention_mask).last_hidden_state
                scores = self.read_scores(hidden[rows, cols]).float().tolist()
            offset = 0
            for i in batch:
                count = len(inputs[i].read_positions)
                results[i] = scores[offset:offset + count]
                offset += count
        return results

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- helpers for subclasses ----------------------------------------------------------------

    def lm_logits(self, hidden: torch.Tensor, token_ids: Sequence[int] | None = None) -> torch.Tensor:
        """[k, hidden] -> float32 LM-head logits [k, vocab], or [k, len(token_ids)] for those tokens."""
        logits = self.model.get_output_embeddings()(hidden)
        if token_ids is not None:
            logits = logits[:, list(token_ids)]
        logits = logits.float()
        cap = getattr(self.model.config.get_text_config(), "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def last_token_id(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ValueError(f"the tokenizer encodes {text!r} to no tokens")
        return ids[-1]

    def render_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))


UNUSED_LM_HEAD = Ignorable("unexpected", r"^lm_head\.weight$",
                           "a reward model fine-tuned from a causal LM may keep the LM head its scores never read")


# ---------------------------------------------------------------------------------------------
# Tokenisation with marked character spans


def tokenize_marked(tokenizer: Any, text: str, marks: Sequence[tuple[int, int]], *,
                    add_special_tokens: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Token ids of `text` and, for each marked character span [start, end), the index of the token
    holding the span's last character.

    Reading positions from character offsets (not by searching for a tag's token id) means a tag
    string that happens to occur inside a step's own text is never mistaken for a step boundary.
    The token found must lie inside the span: a tokenizer that merged the tag with its neighbours
    would make the read-out meaningless, and that is refused.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("verifier adapters need a fast tokenizer (character offsets)")
    encoding = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    positions = []
    cursor = 0
    for start, end in marks:
        last_char = end - 1
        while cursor < len(offsets) and not (offsets[cursor][0] <= last_char < offsets[cursor][1]):
            cursor += 1
        if cursor == len(offsets):
            raise ValueError(f"no token covers the marked text {text[start:end]!r}")
        # A character split over several byte tokens: the last of them completes it.
        while cursor + 1 < len(offsets) and offsets[cursor + 1][0] <= last_char < offsets[cursor + 1][1]:
            cursor += 1
        token_start, token_end = offsets[cursor]
        if token_start < start or token_end > end:
            raise ValueError(f"the tokenizer merged the marked text {text[start:end]!r} with its "
                             f"neighbours into {text[token_start:token_end]!r}")
        positions.append(cursor)
    return tuple(ids), tuple(positions)


# ---------------------------------------------------------------------------------------------
# Batching


def length_batches(inputs: Sequence[ScoringInput], batch_size: int) -> Iterator[list[int]]:
    """Indices of the inputs that have read positions, in batches of similar length."""
    order = sorted((i for i, x in enumerate(inputs) if x.read_positions),
                   key=lambda i: len(inputs[i].token_ids))
    for start in range(0, len(order), batch_size):
        yield order[start:start + batch_size]


def pad_right(sequences: Sequence[Sequence[int]], pad_token_id: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, :len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[row, :len(sequence)] = 1
    return input_ids.to(device), attention_mask.to(device)


def gather_index(positions: Sequence[Sequence[int]],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch rows, sequence columns) selecting every read position of every sequence, in order."""
    rows = [row for row, ps in enumerate(positions) for _ in ps]
    cols = [p for ps in positions for p in ps]
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(cols, dtype=torch.long, device=device))
