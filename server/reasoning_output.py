"""A thinking model's chat answer as vLLM returns it: the thinking in `message.reasoning_content` and
`message.reasoning` (vLLM's older and current names), the answer alone in `content`, and in a stream the
thinking deltas in those fields ahead of the content deltas. The text is split by
`runtime.wire.reasoning` in the model's format (`Ready.reasoning_format`, or the `model.reasoning_parser`
setting); tool calls are then parsed from the answer only (server.tool_output).
"""

from __future__ import annotations

from runtime.wire.reasoning import ReasoningStream, split_reasoning
from server.tool_output import ToolCalls


class Thinking:
    def __init__(self, fmt: str, include: bool = True) -> None:
        self.fmt = fmt
        self.include = include  # vLLM's include_reasoning: false leaves the thinking out
        self.opens: list[bool] = []  # per prompt: its rendered prompt left a thinking block open
        self.n = 1  # choices per prompt
        self.streams: dict[int, ReasoningStream] = {}

    def start(self, opens: list[bool], n: int) -> None:
        """The prompts were admitted: whether each starts its output in thinking (Accepted)."""
        self.opens, self.n = opens, n

    def _starts_open(self, index: int) -> bool:
        prompt = index // self.n
        return self.opens[prompt] if prompt < len(self.opens) else False

    def split(self, index: int, text: str) -> tuple[str | None, str]:
        """A whole choice's text: (its thinking, or None; its answer)."""
        return split_reasoning(text, self.fmt, self._starts_open(index))

    def delta(self, index: int, text: str, is_last: bool) -> tuple[str, str]:
        """A streamed choice's (thinking delta, answer delta) for its next `text`."""
        stream = self.streams.setdefault(index, ReasoningStream(self.fmt, self._starts_open(index)))
        thinking, answer = stream.feed(text)
        if is_last:
            more_thinking, more_answer = stream.finish()
            thinking, answer = thinking + more_thinking, answer + more_answer
        return thinking, answer

    def fields(self, thinking: str | None) -> dict:
        """The message's (or delta's) thinking fields."""
        if not self.include:
            return {}
        return {"reasoning_content": thinking, "reasoning": thinking}


def chat_message(index: int, text: str, reason: str | None, thinking: Thinking | None,
                 tool_calls: ToolCalls | None) -> tuple[dict, str | None]:
    """A chat choice's whole message and finish reason: its thinking apart, the tool calls of its answer."""
    thought, answer = thinking.split(index, text) if thinking is not None else (None, text)
    message, reason = ({"role": "assistant", "content": answer}, reason) if tool_calls is None \
        else tool_calls.message(answer, reason)
    if thinking is not None:
        if thought is not None and not message["content"]:
            message["content"] = None  # all thinking: cut short before any answer
        message.update(thinking.fields(thought))
    return message, reason
