"""What the agent APIs (Anthropic's Messages, OpenAI's Responses) need of the app: the chat route's own
path, so that grammar, tool calls, sampling, search and metrics are written once."""

from __future__ import annotations

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
    dependencies: list[Any]  # the API key check
    keepalive_s: float  # a comment on every stream at least this often
