"""Where a search's step, and its path, end: the same rules for a path's step, a speculative branch's
and a roll-out's."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.model.detokenizer import StepText
from runtime.search.aggregate import normalize_step
from runtime.wire.params import SamplingParams, SearchParams


@dataclass(frozen=True, eq=False)
class StepRules:
    params: SamplingParams
    search: SearchParams
    tokenizer: object
    eos_ids: frozenset[int]
    num_prompt_tokens: int
    max_tokens: int  # of output
    max_model_len: int
    stops_on_boxed: bool  # a path ends on a boxed answer (DVTS)

    def outcome(self, owner, token: int, step_start: int, *, is_last_step: bool) -> tuple[str | None, bool]:
        """After `token` of `owner` (a path, branch or roll-out: its `seq` and `step_text`): the finish
        reason if the path ends, and whether its step ends.

        A path ends on EOS or a stop token, at the length limit, on a boxed answer (DVTS) or on an
        empty step; a step ends at the delimiter or `max_step_tokens`, except on the last step."""
        params, search, seq = self.params, self.search, owner.seq
        if owner.step_text is None or owner.step_text.start != step_start:
            owner.step_text = StepText(self.tokenizer, step_start)
        text = owner.step_text.text(seq.token_ids)
        if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
            return "stop", False
        if len(seq.token_ids) - self.num_prompt_tokens >= self.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length", False
        if self.stops_on_boxed and "\\boxed{" in text and "}" in text.split("\\boxed{")[-1]:
            return "stop", False
        ends = not is_last_step and (search.step_delimiter in text
                                     or len(seq.token_ids) - step_start >= search.max_step_tokens)
        if ends and not normalize_step(text, search.step_delimiter).strip():
            return "stop", False  # an empty step ends the path
        return None, ends
