"""`POST /v1/messages` and `POST /v1/messages/count_tokens` over the chat path (server.chat_bridge)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from server.chat_bridge import ChatBridge
from server.messages_api.output import MessageStream, message_body
from server.messages_api.schemas import CountTokensRequest, MessagesRequest


def _keepalive() -> ServerSentEvent:
    return ServerSentEvent(comment="keep-alive", sep="\n")


async def _events(chunks: AsyncIterator[bytes], stream: MessageStream) -> AsyncIterator[bytes]:
    # Closing the chat stream runs its own ending: the request is aborted if unfinished and accounted.
    async with contextlib.aclosing(chunks):
        async for raw in chunks:
            for out in stream.feed(raw):
                yield out


def install(app: FastAPI, bridge: ChatBridge) -> None:
    @app.post("/v1/messages", dependencies=bridge.dependencies)
    async def messages(body: MessagesRequest, request: Request):
        answer = await bridge.run(body.to_chat(), request, "messages")
        stops = body.stop_sequences or []
        if not body.stream:
            return JSONResponse(message_body(json.loads(answer.body), stops))
        return EventSourceResponse(_events(answer.body_iterator, MessageStream(stops)), ping=bridge.keepalive_s,
                                   ping_message_factory=_keepalive, sep="\n", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/messages/count_tokens", dependencies=bridge.dependencies)
    async def count_tokens(body: CountTokensRequest):
        return {"input_tokens": await bridge.count_tokens(body.to_chat())}
