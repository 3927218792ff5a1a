"""A chat answer's tool calls as OpenAI returns them: `message.tool_calls` (or the deprecated
`function_call`), `finish_reason: "tool_calls"`, and in a stream one `tool_calls` delta per call as it
completes. The text is parsed by `runtime.wire.tool_calls` in the model's format (`Ready.tool_call_format`).
"""

from __future__ import annotations

from runtime.wire.tool_calls import ParsedCall, ToolCallStream, parse_tool_calls


class ToolCalls:
    def __init__(self, fmt: str, legacy: bool = False) -> None:
        self.fmt = fmt
        self.legacy = legacy  # the request used `functions`: answer with `function_call`
        self.streams: dict[int, ToolCallStream] = {}
        self.counts: dict[int, int] = {}  # calls sent per choice

    def finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        if reason is None or not has_calls:
            return reason
        return "function_call" if self.legacy else "tool_calls"

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The whole answer: (the message, its finish reason)."""
        content, calls = parse_tool_calls(text, self.fmt)
        message: dict = {"role": "assistant", "content": content}
        if calls and self.legacy:
            message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
        elif calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        else:
            message["content"] = text
        return message, self.finish_reason(reason, bool(calls))

    def delta(self, index: int, text: str, reason: str | None) -> tuple[dict, str | None]:
        """A streamed choice's delta for `text`, with what completed; (delta, finish reason)."""
        stream = self.streams.setdefault(index, ToolCallStream(self.fmt))
        content, calls = stream.feed(text)
        if reason is not None:
            rest, more = stream.finish()
            content, calls = content + rest, calls + more
        delta: dict = {"content": content} if content else {}
        if calls:
            delta.update(self._calls(index, calls))
        return delta, self.finish_reason(reason, stream.num_calls > 0)

    def _calls(self, index: int, calls: list[ParsedCall]) -> dict:
        start = self.counts.get(index, 0)
        self.counts[index] = start + len(calls)
        if self.legacy:
            return {"function_call": {"name": calls[0].name, "arguments": calls[0].arguments}}
        return {"tool_calls": [{"index": start + k, **call.to_openai()} for k, call in enumerate(calls)]}
