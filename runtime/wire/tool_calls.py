"""Turning a model's text into OpenAI `tool_calls` (text work, no torch: both processes use it).

Formats (`runtime.grammar.tools`): `hermes` (`<tool_call>{"name", "arguments"}</tool_call>` blocks),
`llama3_json` (a bare `{"name", "parameters"}` object, several joined by "; ") and `mistral`
(`[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}`). `ToolCallStream` turns text deltas into
content deltas and whole calls as they complete, holding back only what could still begin a call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "{"}


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, call_id: str | None = None) -> dict:
        return {"id": call_id or "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}

    def canonical(self) -> str:
        return json.dumps([self.name, json.loads(self.arguments)], sort_keys=True, separators=(",", ":"))


def _call(obj, key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(key, obj.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _json_values(text: str) -> list | None:
    """The JSON values `text` holds one after another (separated by whitespace or ";"), or None."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[ParsedCall]]:
    """(the content outside the calls, or None when there is none; the calls). Text that is not a
    whole, well-formed call stays content."""
    if fmt == "hermes":
        calls, content, rest = [], [], text
        while "<tool_call>" in rest:
            before, _, after = rest.partition("<tool_call>")
            body, closed, rest = after.partition("</tool_call>")
            values = _json_values(body) if closed else None
            parsed = [_call(v, "arguments") for v in values] if values else [None]
            if None in parsed:
                content.append(before + "<tool_call>" + body + closed)
                continue
            content.append(before)
            calls += parsed
        content.append(rest)
        joined = "".join(content).strip() if calls else "".join(content)
        return joined or None, calls
    if fmt == "mistral":
        before, marker, after = text.partition("[TOOL_CALLS]")
        values = _json_values(after) if marker else None
        items = values[0] if values and len(values) == 1 and isinstance(values[0], list) else None
        parsed = [_call(v, "arguments") for v in items] if items else [None]
        if None in parsed:
            return text or None, []
        return before.strip() or None, parsed  # type: ignore[return-value]
    values = _json_values(text) if text.lstrip().startswith("{") else None
    parsed = [_call(v, "parameters") for v in values] if values else [None]
    if None in parsed:
        return text or None, []
    return None, parsed  # type: ignore[return-value]


class ToolCallStream:
    """Text deltas in; content deltas and finished calls out. Content that might start a call is held
    until it cannot (or the text ends)."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.marker = _MARKERS[fmt]
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.num_calls = 0  # calls sent
        self.in_calls = False  # a call began: everything from here is parsed at the end or as calls close

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self.text += delta
        if self.fmt == "hermes":
            return self._hermes()
        if not self.in_calls:
            start = self.text.find(self.marker) if self.fmt == "mistral" else (
                0 if self.text.lstrip().startswith("{") else -1 if self.text.strip() else -2)
            if start >= 0:
                self.in_calls = True
                content, self.sent = self.text[self.sent:start], start
                return content, []
            if start == -2:  # only whitespace so far: it may still open a JSON call
                return "", []
            hold = _partial_suffix(self.text, self.marker) if self.fmt == "mistral" else 0
            content, self.sent = self.text[self.sent:len(self.text) - hold], len(self.text) - hold
            return content, []
        return "", []

    def _hermes(self) -> tuple[str, list[ParsedCall]]:
        content, calls = "", []
        while True:
            rest = self.text[self.sent:]
            start = rest.find("<tool_call>")
            if start < 0:
                hold = _partial_suffix(rest, "<tool_call>")
                if not self.in_calls:
                    content += rest[:len(rest) - hold]
                    self.sent += len(rest) - hold
                return content, calls
            end = rest.find("</tool_call>", start)
            if not self.in_calls:
                content += rest[:start]
            self.sent += start
            self.in_calls = True
            if end < 0:
                return content, calls
            block = rest[start:end + len("</tool_call>")]
            _, parsed = parse_tool_calls(block, "hermes")
            calls += parsed
            self.num_calls += len(parsed)
            self.sent += len(block)

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The end of the text: what is left, as content or calls."""
        rest = self.text[self.sent:]
        self.sent = len(self.text)
        if self.fmt == "hermes":
            if not rest.strip():
                return ("" if self.num_calls else rest), []
            content, calls = parse_tool_calls(rest, "hermes")
            self.num_calls += len(calls)
            return content or "", calls
        content, calls = parse_tool_calls(rest, self.fmt)
        self.num_calls += len(calls)
        return content or "", calls


def _partial_suffix(text: str, marker: str) -> int:
    """How many final characters of `text` are a proper beginning of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
