"""`POST /v1/responses` over the chat path (server.chat_bridge), and the stored responses:
`GET` / `DELETE /v1/responses/{id}` and `GET /v1/responses/{id}/input_items`."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from server.chat_bridge import ChatBridge
from server.errors import APIError
from server.responses_api.output import ResponseStream, new_id, response_body
from server.responses_api.schemas import ResponsesRequest
from server.responses_api.store import ResponseStore

_ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _keepalive() -> ServerSentEvent:
    return ServerSentEvent(comment="keep-alive", sep="\n")


def _with_ids(items: list[Any]) -> list[Any]:
    """Input items as input_items lists them: each with an id (its own, or a new one), a message's text
    as one input_text part (output_text for an assistant's)."""
    out = []
    for item in items:
        if isinstance(item, dict):
            kind = item.get("type", "message")
            item = {"id": new_id(_ITEM_PREFIXES.get(kind, "item")), "type": kind, **item}
            if kind == "message" and isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
        out.append(item)
    return out


def envelope(body: ResponsesRequest, response_id: str, model: str, is_stored: bool) -> dict:
    """The response's fields that echo the request, the same on every event and in the stored copy."""
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else \
        {"type": "text"}
    tool_choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": model, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": is_stored, "temperature": body.temperature, "text": {"format": fmt},
            "tool_choice": tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []], "top_p": body.top_p,
            "top_logprobs": body.top_logprobs, "truncation": "disabled", "usage": None, "user": body.user,
            "metadata": body.metadata or {}}


def install(app: FastAPI, bridge: ChatBridge, store: ResponseStore | None) -> None:
    def stored(response_id: str):
        if store is None:
            raise APIError(404, f"Response with id '{response_id}' not found: this server does not store responses "
                                "(responses.store is false)", code="response_not_found")
        found = store.get(response_id)
        if found is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", code="response_not_found")
        return found

    @app.post("/v1/responses", dependencies=bridge.dependencies)
    async def create(body: ResponsesRequest, request: Request):
        body.check()
        history: list[Any] = []
        if body.previous_response_id is not None:
            try:
                previous = stored(body.previous_response_id)
            except APIError as err:
                raise APIError(400, err.message, "previous_response_id", "previous_response_not_found") from None
            history = previous.items + previous.response["output"]
        history += _with_ids(body.input_items())
        chat = body.to_chat(history)
        answer = await bridge.run(chat, request, "responses")
        is_stored = store is not None and body.store is not False
        start = envelope(body, new_id("resp"), bridge.model(chat.model), is_stored)
        if not body.stream:
            response = response_body(start, json.loads(answer.body))
            if is_stored:
                store.put(response, history)  # type: ignore[union-attr]
            return JSONResponse(response)
        return EventSourceResponse(_events(answer.body_iterator, ResponseStream(start), store if is_stored else None,
                                           history), ping=bridge.keepalive_s, ping_message_factory=_keepalive,
                                   sep="\n", headers={"Cache-Control": "no-cache"})

    @app.get("/v1/responses/{response_id}", dependencies=bridge.dependencies)
    async def retrieve(response_id: str):
        return stored(response_id).response

    @app.delete("/v1/responses/{response_id}", dependencies=bridge.dependencies)
    async def delete(response_id: str):
        stored(response_id)
        store.delete(response_id)  # type: ignore[union-attr]
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items", dependencies=bridge.dependencies)
    async def input_items(response_id: str, limit: int = Query(20, ge=1, le=100),
                          order: Literal["asc", "desc"] = "desc", after: str | None = None):
        items = stored(response_id).items
        items = items[::-1] if order == "desc" else items
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise APIError(400, f"no input item {after!r} in this response", "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


async def _events(chunks: AsyncIterator[bytes], stream: ResponseStream, store: ResponseStore | None,
                  history: list[Any]) -> AsyncIterator[bytes]:
    # Closing the chat stream runs its own ending: the request is aborted if unfinished and accounted.
    async with contextlib.aclosing(chunks):
        for out in stream.start():
            yield out
        async for raw in chunks:
            for out in stream.feed(raw):
                yield out
    if store is not None and stream.final is not None:
        store.put(stream.final, history)
