"""What the agent APIs (Anthropic's Messages, OpenAI's Responses) need of the app: the chat route's own
path, so that grammar, tool calls, sampling, search and metrics are written once."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from server.schemas import ChatCompletionRequest


@dataclass(frozen=True)
class ChatBridge:
    # Runs a chat request as /v1/chat/completions does, counted in metrics under the label given: a
    # JSONResponse with the chat completion, or (stream) an EventSourceResponse whose body_iterator
    # yields the chat chunks as SSE bytes.
    run: Callable[[ChatCompletionRequest, Request, str], Awaitable[Response]]
    # The prompt tokens the chat request would report (its messages and tools through the chat template).
    count_tokens: Callable[[ChatCompletionRequest], Awaitable[int]]
    model: Callable[[str | None], str]  # the served model's name: a 404 for another's, a 503 while loading
    dependencies: list[Any]  # the API key check
    keepalive_s: float  # a comment on every stream at least this often


def read_chat_event(raw: bytes) -> tuple[str, Any]:
    """One SSE message of the chat stream as (kind, value): ("comment", raw) for a comment (keep-alives and
    search progress, which every SSE parser skips: passed through), ("done", None) at `[DONE]`, ("error",
    the error object) for an error chunk, else ("chunk", the chunk)."""
    if raw.startswith(b":"):
        return "comment", raw
    if raw.strip() == b"data: [DONE]":
        return "done", None
    chunk = json.loads(raw.decode().removeprefix("data: "))
    return ("error", chunk["error"]) if "error" in chunk else ("chunk", chunk)


class ChatStreamTranslation:
    """Turns the chat route's SSE messages (one choice, continuous usage) into another API's events:
    comments pass through, an error chunk ends the stream (`_failed`), `[DONE]` ends it (`_end`), and each
    chunk updates the usage and the search summary, then is turned choice by choice (`_choice`), after
    what the API sends first (`_opening`)."""

    def __init__(self) -> None:
        self.failed = False
        self.usage: dict | None = None
        self.summary: dict | None = None  # the search summary, on the last chunk of a search

    def feed(self, raw: bytes) -> list[bytes]:
        kind, chunk = read_chat_event(raw)
        if kind == "comment":
            return [raw]
        if kind == "done":
            return [] if self.failed else self._end()
        if kind == "error":
            self.failed = True
            return self._failed(chunk)
        out = self._opening(chunk)
        self.usage = chunk.get("usage") or self.usage
        if chunk.get("search") is not None:
            self.summary = chunk["search"]
        for choice in chunk.get("choices", ()):
            out.extend(self._choice(choice))
        return out

    def _opening(self, chunk: dict) -> list[bytes]:
        return []

    def _choice(self, choice: dict) -> list[bytes]:
        raise NotImplementedError

    def _failed(self, error: dict) -> list[bytes]:
        raise NotImplementedError

    def _end(self) -> list[bytes]:
        raise NotImplementedError


def search_of(summary: dict | None, path: dict | None) -> dict | None:
    """ponder's `search` on an answer of one choice: the chat answer's summary of the search, with the
    chosen path's score, step scores and answer beside it."""
    if summary is None and path is None:
        return None
    return {**(summary or {}), **(path or {})}
