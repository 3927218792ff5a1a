"""The chat path's answer as OpenAI's Responses answer: a whole `response`, or a chat stream's chunks as
the Responses events the `openai` SDK parses (`response.created`, `response.output_item.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`, `response.completed`, ...).

Output items come in the order the model wrote them: a reasoning model's thinking (the chat answer's
`reasoning_content`) as a reasoning item, a message (its text as one output_text part), then each
function call once the chat path has parsed it whole. A chat answer cut at the token limit is
`incomplete` (reason max_output_tokens).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from server.chat_bridge import ChatStreamTranslation, search_of


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(usage: dict | None) -> dict:
    usage = usage or {}
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def text_part(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(item_id: str, text: str | None, status: str, logprobs: list | None = None) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if text is None else [text_part(text, logprobs)]}


def logprobs_of(choice: dict) -> list:
    """The chat choice's (or chunk's) token logprobs: OpenAI's entries, the same in both APIs."""
    return (choice.get("logprobs") or {}).get("content") or []


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(item_id: str, call: dict, status: str, arguments: str | None = None) -> dict:
    function = call["function"]
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": function["name"],
            "arguments": function["arguments"] if arguments is None else arguments, "status": status}


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def response_body(envelope: dict, chat: dict) -> dict:
    """A chat completion (one choice) as the response `envelope` (server.responses_api.routes) finished."""
    choice = chat["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    output: list[dict] = []
    if message.get("reasoning_content"):
        output.append(reasoning_item(new_id("rs"), message["reasoning_content"], "completed"))
    text = message.get("content") or ""
    if text or not calls:
        output.append(message_item(new_id("msg"), text, "completed", logprobs_of(choice)))
    output.extend(call_item(new_id("fc"), call, "completed") for call in calls)
    status, incomplete = status_of(choice["finish_reason"])
    body = {**envelope, "status": status, "incomplete_details": incomplete, "output": output,
            "usage": responses_usage(chat["usage"])}
    search = search_of(chat.get("search"), choice.get("search"))
    if search is not None:
        body["search"] = search
    return body


class ResponseStream(ChatStreamTranslation):
    """Turns the chat path's SSE chunks (one choice, continuous usage) into Responses events; `final`
    holds the finished response (None until then, and after a failure)."""

    def __init__(self, envelope: dict) -> None:
        super().__init__()
        self.envelope = envelope
        self.sequence = 0
        self.output: list[dict] = []  # finished items
        self.message: dict | None = None  # the message item being written
        self.reasoning: dict | None = None  # the reasoning item being written
        self.finish_reason: str | None = None
        self.path: dict | None = None
        self.final: dict | None = None
        self.failed = False

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **payload}, ensure_ascii=False,
                          separators=(",", ":"))
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def start(self) -> list[bytes]:
        snapshot = {**self.envelope, "status": "in_progress", "output": [], "usage": None}
        return [self._event("response.created", {"response": snapshot}),
                self._event("response.in_progress", {"response": snapshot})]

    def _failed(self, error: dict) -> list[bytes]:
        failed = {**self.envelope, "status": "failed", "output": self.output, "usage": None,
                  "error": {"code": error.get("code") or "server_error", "message": error["message"]}}
        return [self._event("response.failed", {"response": failed})]

    def _choice(self, choice: dict) -> list[bytes]:
        delta = choice.get("delta") or {}
        out: list[bytes] = []
        if choice.get("search") is not None:
            self.path = choice["search"]
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        if delta.get("reasoning_content"):
            out += self._open_reasoning()
            self.reasoning["content"][0]["text"] += delta["reasoning_content"]  # type: ignore[index]
            out.append(self._event("response.reasoning_text.delta", {
                "item_id": self.reasoning["id"], "output_index": len(self.output), "content_index": 0,  # type: ignore[index]
                "delta": delta["reasoning_content"]}))
        if delta.get("content"):
            out += self._close_reasoning()
            out += self._open_message()
            logprobs = logprobs_of(choice)
            self.message["content"][0]["text"] += delta["content"]  # type: ignore[index]
            self.message["content"][0]["logprobs"] += logprobs  # type: ignore[index]
            out.append(self._event("response.output_text.delta", {
                "item_id": self.message["id"], "output_index": len(self.output), "content_index": 0,  # type: ignore[index]
                "delta": delta["content"], "logprobs": logprobs}))
        for call in delta.get("tool_calls") or ():
            out += self._close_reasoning() + self._close_message()
            item_id, index = new_id("fc"), len(self.output)
            out.append(self._event("response.output_item.added",
                                   {"output_index": index, "item": call_item(item_id, call, "in_progress", "")}))
            arguments = call["function"]["arguments"]
            out.append(self._event("response.function_call_arguments.delta",
                                   {"item_id": item_id, "output_index": index, "delta": arguments}))
            out.append(self._event("response.function_call_arguments.done", {
                "item_id": item_id, "output_index": index, "name": call["function"]["name"], "arguments": arguments}))
            item = call_item(item_id, call, "completed")
            self.output.append(item)
            out.append(self._event("response.output_item.done", {"output_index": index, "item": item}))
        return out

    def _open_reasoning(self) -> list[bytes]:
        if self.reasoning is not None:
            return []
        self.reasoning = reasoning_item(new_id("rs"), "", "in_progress")
        return [self._event("response.output_item.added", {"output_index": len(self.output), "item": self.reasoning})]

    def _close_reasoning(self) -> list[bytes]:
        if self.reasoning is None:
            return []
        item, self.reasoning = self.reasoning, None
        item["status"] = "completed"
        index = len(self.output)
        self.output.append(item)
        return [self._event("response.reasoning_text.done", {"item_id": item["id"], "output_index": index,
                                                              "content_index": 0, "text": item["content"][0]["text"]}),
                self._event("response.output_item.done", {"output_index": index, "item": item})]

    def _open_message(self) -> list[bytes]:
        if self.message is not None:
            return []
        self.message = message_item(new_id("msg"), None, "in_progress")
        index = len(self.output)
        out = [self._event("response.output_item.added", {"output_index": index, "item": dict(self.message)})]
        self.message["content"] = [text_part("")]
        out.append(self._event("response.content_part.added", {"item_id": self.message["id"], "output_index": index,
                                                                "content_index": 0, "part": text_part("")}))
        return out

    def _close_message(self) -> list[bytes]:
        if self.message is None:
            return []
        item, self.message = self.message, None
        index, part = len(self.output), item["content"][0]
        item["status"] = "completed"
        self.output.append(item)
        return [self._event("response.output_text.done", {"item_id": item["id"], "output_index": index,
                                                           "content_index": 0, "text": part["text"],
                                                           "logprobs": part["logprobs"]}),
                self._event("response.content_part.done", {"item_id": item["id"], "output_index": index,
                                                            "content_index": 0, "part": part}),
                self._event("response.output_item.done", {"output_index": index, "item": item})]

    def _end(self) -> list[bytes]:
        out: list[bytes] = self._close_reasoning()
        if not any(item["type"] != "reasoning" for item in self.output) and self.message is None:
            # an answer with no text and no call is still one (empty) message
            out += self._open_message()
        out += self._close_message()
        status, incomplete = status_of(self.finish_reason)
        self.final = {**self.envelope, "status": status, "incomplete_details": incomplete, "output": self.output,
                      "usage": responses_usage(self.usage)}
        search = search_of(self.summary, self.path)
        if search is not None:
            self.final["search"] = search
        return out + [self._event(f"response.{status}", {"response": self.final})]
