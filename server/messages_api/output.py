"""The chat path's answer as Anthropic's: a whole `message`, or a chat stream's chunks as Anthropic's events
(`message_start`, `content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`).

Content blocks come in the order the model wrote them: thinking (a chat delta's `reasoning_content`),
text, then each tool call as a `tool_use` block once the chat path has parsed it whole. A chat
request for stop sequences keeps the one met at the end of its text (include_stop_str_in_output):
it is cut off here and named in `stop_sequence`, as Anthropic answers.
"""

from __future__ import annotations

import json
from typing import Any

from server.chat_bridge import ChatStreamTranslation, search_of

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}


def stop_of(text: str, finish_reason: str | None, stops: list[str]) -> tuple[str, str | None, str | None]:
    """(the text without the stop sequence it ends with, stop_reason, stop_sequence)."""
    if finish_reason == "stop":
        for stop in stops:
            if text.endswith(stop):
                return text[:-len(stop)], "stop_sequence", stop
        return text, "end_turn", None
    return text, _STOP_REASONS.get(finish_reason or "", "end_turn"), None


def tool_use_block(call: dict) -> dict:
    function = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": function["name"], "input": json.loads(function["arguments"])}


def anthropic_usage(usage: dict | None) -> dict:
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def message_body(chat: dict, stops: list[str]) -> dict:
    """A chat completion (one choice) as Anthropic's message."""
    choice = chat["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    content: list[dict] = []
    reasoning = message.get("reasoning_content")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text, reason, stop = stop_of(message.get("content") or "", choice["finish_reason"], stops)
    if text or not calls:
        content.append({"type": "text", "text": text})
    content.extend(tool_use_block(call) for call in calls)
    body = {"id": message_id(chat["id"]), "type": "message", "role": "assistant", "model": chat["model"],
            "content": content, "stop_reason": reason, "stop_sequence": stop, "usage": anthropic_usage(chat["usage"])}
    search = search_of(chat.get("search"), choice.get("search"))
    if search is not None:
        body["search"] = search
    return body


def event(kind: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps({"type": kind, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


class MessageStream(ChatStreamTranslation):
    """Turns the chat path's SSE chunks (one choice, continuous usage) into Anthropic's events."""

    def __init__(self, stops: list[str]) -> None:
        super().__init__()
        self.stops = stops
        self.started = False
        self.block: str | None = None  # the kind of the open content block
        self.num_blocks = 0
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None
        self.path: dict | None = None

    def _opening(self, chunk: dict) -> list[bytes]:
        return [] if self.started else [self._start(chunk)]

    def _failed(self, error: dict) -> list[bytes]:
        return [event("error", {"error": {"type": error.get("type") or "api_error", "message": error["message"]}})]

    def _start(self, chunk: dict) -> bytes:
        self.started = True
        usage = anthropic_usage(chunk.get("usage"))
        message = {"id": message_id(chunk["id"]), "type": "message", "role": "assistant", "model": chunk["model"],
                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
        return event("message_start", {"message": message})

    def _choice(self, choice: dict) -> list[bytes]:
        delta = choice.get("delta") or {}
        out: list[bytes] = []
        if choice.get("search") is not None:
            self.path = choice["search"]
        reasoning = delta.get("reasoning_content")
        if reasoning:
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        text = delta.get("content") or ""
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            text, _, self.stop_sequence = stop_of(text, self.finish_reason, self.stops)
        if text:
            out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or ():
            out += self._close()
            block = tool_use_block(call)
            out += self._open("tool_use", {**block, "input": {}})
            out.append(self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
            out += self._close()
        return out

    def _open(self, kind: str, block: dict) -> list[bytes]:
        if self.block == kind:
            return []
        out = self._close()
        self.block = kind
        out.append(event("content_block_start", {"index": self.num_blocks, "content_block": block}))
        return out

    def _delta(self, delta: dict) -> bytes:
        return event("content_block_delta", {"index": self.num_blocks, "delta": delta})

    def _close(self) -> list[bytes]:
        if self.block is None:
            return []
        self.block = None
        self.num_blocks += 1
        return [event("content_block_stop", {"index": self.num_blocks - 1})]

    def _end(self) -> list[bytes]:
        out: list[bytes] = []
        if self.num_blocks == 0 and self.block is None:  # an empty answer is still one (empty) text block
            out += self._open("text", {"type": "text", "text": ""})
        out += self._close()
        _, reason, _ = stop_of("", self.finish_reason, [])
        if self.stop_sequence is not None:
            reason = "stop_sequence"
        usage = anthropic_usage(self.usage)
        message_delta = {"delta": {"stop_reason": reason, "stop_sequence": self.stop_sequence},
                         "usage": {"output_tokens": usage["output_tokens"]}}
        search = search_of(self.summary, self.path)
        if search is not None:
            message_delta["search"] = search
        return out + [event("message_delta", message_delta), event("message_stop", {})]
