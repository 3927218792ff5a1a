"""Running one OpenAI generation request against the runtime: submit, collect or stream, account."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from runtime.wire.client import RequestHandle, RuntimeClient, RuntimeUnavailable
from runtime.wire.protocol import Accepted, Delta, Finished, GenerateRequest, RequestError, SearchEvent
from server.errors import APIError
from server.metrics import Metrics
from server.responses import (
    ChoiceText, ChunkWriter, PromptAsks, chat_logprobs, completion_logprobs, prompt_logprobs_field, search_field,
    summary_field, usage,
)
from server.reasoning_output import Thinking, chat_message
from server.tool_output import ToolCalls
from server.trees import CANCELLED, FAILED, FINISHED, SearchTrees

log = logging.getLogger("ponder.requests")

# SSE comments: every SSE parser (the OpenAI SDKs' included) skips lines starting with ":".
SEARCH_STARTED = b": search started\n\n"


def _keepalive() -> ServerSentEvent:
    return ServerSentEvent(comment="keep-alive", sep="\n")


def _progress_comment(event: SearchEvent) -> bytes:
    return f": search step {event.step}, {event.live_paths} live paths\n\n".encode()


class Generation:
    """One HTTP request: one runtime request per prompt, choices numbered prompt-major."""

    def __init__(self, client: RuntimeClient, metrics: Metrics, http: Request, model: str, endpoint: str,
                 requests: list[GenerateRequest], n: int, stream: bool, include_usage: bool,
                 include_search_events: bool, keepalive_s: float, trees: SearchTrees | None = None,
                 asks: PromptAsks = PromptAsks(), tool_calls: ToolCalls | None = None,
                 label: str | None = None, thinking: Thinking | None = None) -> None:
        self.client = client
        self.metrics = metrics
        self.http = http
        self.model = model
        self.endpoint = endpoint
        self.is_chat = endpoint == "chat"
        self.label = label or endpoint  # the endpoint named in metrics and the log: the API the client spoke
        self.requests = requests
        self.n = n
        self.stream = stream
        self.include_usage = include_usage
        self.include_search_events = include_search_events  # the client asked for search event chunks
        self.keepalive_s = keepalive_s
        self.trees = trees  # where the page at /ui watches each search's tree
        self.asks = asks  # echoed and prompt logprobs, continuous usage
        self.tool_calls = tool_calls  # the request offered tools: the answer is parsed for calls
        self.thinking = thinking  # the model thinks in its text: thinking and answer are told apart
        self.prompt_tokens = 0  # of every admitted prompt (Accepted), for continuous usage
        self.is_search = any(r.search is not None for r in requests)
        prefix = "chatcmpl-" if self.is_chat else "cmpl-"
        self.response_id = prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.started = time.monotonic()
        self.handles: list[RequestHandle] = []
        self.finished: list[Finished] = []
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finish_reasons: list[str] = []
        self.status = 200

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self):
        self.metrics.request_started(self.label)
        try:
            await self._submit_all()
        except APIError as err:
            self._account(err.status)
            raise
        except asyncio.CancelledError:
            self._abort_all()
            self._account(499)  # the client went away while its prompt was being admitted
            raise
        except Exception:
            self._abort_all()
            self._account(500)  # a bug: still counted, nothing left in flight
            raise
        if self.stream:
            # A comment every keepalive_s, while the body waits on a long search step too, keeps proxies
            # and clients from timing the connection out.
            return EventSourceResponse(self._stream(), ping=self.keepalive_s, ping_message_factory=_keepalive,
                                       sep="\n", headers={"Cache-Control": "no-cache"})
        return await self._collect()

    async def _submit_all(self) -> None:
        """Submit every prompt and wait until each is admitted, so input errors are plain 4xx responses."""
        try:
            for request in self.requests:
                self.handles.append(self.client.submit(request))
                if self.trees is not None:
                    self.trees.start(request)  # before the first tree update can arrive
        except RuntimeUnavailable as exc:
            self._abort_all()
            raise APIError(503, str(exc), code="runtime_unavailable") from None
        opens = []
        for handle in self.handles:
            first = await self._next(handle)
            if isinstance(first, Accepted):
                self.prompt_tokens += first.prompt_tokens
                opens.append(first.opens_thinking)
            if isinstance(first, RequestError):
                self._abort_all()
                if self.trees is not None:  # a rejected request was never a search worth showing
                    for request in self.requests:
                        self.trees.forget(request.request_id)
                raise APIError(first.status, first.message, first.param, first.code, first.type)
        if self.thinking is not None:
            self.thinking.start(opens, self.n)

    @staticmethod
    async def _next(handle: RequestHandle):
        return await handle.queue.get()

    def _abort_all(self) -> None:
        for handle in self.handles:
            if not handle.done:
                self.client.abort(handle.request_id)

    def _account(self, status: int) -> None:
        self.status = status
        if self.trees is not None:
            state = FINISHED if status == 200 else CANCELLED if status == 499 else FAILED
            for request in self.requests:
                self.trees.end(request.request_id, state)
        latency = time.monotonic() - self.started
        self.metrics.request_finished(self.label, status, latency)
        log.info("request %s endpoint=%s status=%s prompt_tokens=%s completion_tokens=%s latency=%.3fs "
                 "finish=%s strategy=%s", self.response_id, self.label, status,
                 sum(f.prompt_tokens for f in self.finished), sum(f.completion_tokens for f in self.finished),
                 latency, ",".join(self.finish_reasons) or "-",
                 self.requests[0].search.strategy if self.requests and self.requests[0].search else "-")

    def _observe_tokens(self, delta: Delta) -> None:
        now = time.monotonic()
        count = len(delta.token_ids)
        if count == 0:
            return
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.observe_ttft(now - self.started)
        elif self.last_token_at is not None:
            self.metrics.observe_inter_token((now - self.last_token_at) / count)
        self.last_token_at = now

    async def _messages(self, handle_index: int) -> AsyncIterator:
        handle = self.handles[handle_index]
        async for message in handle.messages():
            if isinstance(message, Delta):
                self._observe_tokens(message)
                message = msgspec.structs.replace(message, index=handle_index * self.n + message.index)
                if message.finish_reason is not None:
                    self.finish_reasons.append(message.finish_reason)
            elif isinstance(message, Finished):
                self.finished.append(message)
            yield message

    # -- non-streaming --------------------------------------------------------------------------
    async def _collect(self) -> JSONResponse:
        choices = [ChoiceText() for _ in range(len(self.handles) * self.n)]
        watcher = asyncio.create_task(self._watch_disconnect())
        try:
            for index in range(len(self.handles)):
                async for message in self._messages(index):
                    if isinstance(message, Delta):
                        choices[message.index].add(message)
                    elif isinstance(message, RequestError):
                        raise APIError(message.status, message.message, message.param, message.code, message.type)
        except APIError as err:
            self._abort_all()
            self._account(err.status)
            raise
        except asyncio.CancelledError:
            self._abort_all()
            self._account(499)
            raise
        finally:
            watcher.cancel()
        self.metrics.add_returned_tokens(sum(c.num_tokens for c in choices))
        self._account(200)
        return JSONResponse(self._body(choices))

    async def _watch_disconnect(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            if await self.http.is_disconnected():
                self._abort_all()
                return

    def _body(self, choices: list[ChoiceText]) -> dict:
        out = []
        asks = self.asks
        for index, c in enumerate(choices):
            if self.is_chat:
                message, reason = chat_message(index, c.text, c.finish_reason, self.thinking, self.tool_calls)
                item = {"index": index, "message": message,
                        "logprobs": chat_logprobs(c.logprobs) if c.logprobs else None,
                        "finish_reason": reason}
            else:
                echoed = c.prompt_logprobs if asks.echo_logprobs is not None else ()
                item = {"index": index, "text": c.text,
                        "logprobs": completion_logprobs(c.logprobs, 0, echoed, asks.echo_logprobs or 0)
                        if c.logprobs or echoed else None,
                        "finish_reason": c.finish_reason}
                if asks.prompt_logprobs is not None:
                    item["prompt_logprobs"] = prompt_logprobs_field(c.prompt_logprobs, asks.prompt_logprobs)
            if c.search is not None:
                item["search"] = search_field(c.search)
            out.append(item)
        body = {"id": self.response_id, "object": "chat.completion" if self.is_chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out, "usage": usage(self.finished)}
        if self.is_chat and asks.prompt_logprobs is not None and choices:  # vLLM: one prompt, at the top level
            body["prompt_logprobs"] = prompt_logprobs_field(choices[0].prompt_logprobs, asks.prompt_logprobs)
        summaries = [f.search for f in self.finished if f.search is not None]
        if summaries:
            body["search"] = summary_field(summaries[0])
        return body

    # -- streaming ------------------------------------------------------------------------------
    async def _stream(self) -> AsyncIterator[bytes]:
        writer = ChunkWriter(self.response_id, self.created, self.model, self.is_chat, self.include_usage, self.asks)
        writer.prompt_tokens = self.prompt_tokens
        status = 200
        returned = 0
        text_offsets: dict[int, int] = {}
        try:
            if self.is_search:
                yield SEARCH_STARTED
            if self.is_chat:
                for index in range(len(self.handles) * self.n):
                    yield writer.role_chunk(index)
            for handle_index in range(len(self.handles)):
                async for message in self._messages(handle_index):
                    if isinstance(message, Delta):
                        returned += len(message.token_ids)
                        writer.completion_tokens = returned
                        yield writer.delta_chunk(message, text_offsets.get(message.index, 0), self.tool_calls,
                                                 self.thinking)
                        text_offsets[message.index] = text_offsets.get(message.index, 0) + len(message.text) + \
                            len(message.prompt_text or "")
                    elif isinstance(message, SearchEvent) and self.include_search_events:
                        yield writer.chunk([], search={"step": message.step, "live_paths": message.live_paths,
                                                       "scores": list(message.scores)})
                    elif isinstance(message, SearchEvent):
                        yield _progress_comment(message)
                    elif isinstance(message, RequestError):
                        status = message.status
                        yield writer.error(message.status, message.message, message.type, message.code)
                        self._abort_all()
                        yield writer.DONE
                        return
            if self.include_usage:
                yield writer.usage_chunk(self.finished)
            summaries = [f.search for f in self.finished if f.search is not None]
            if summaries:
                yield writer.chunk([], search=summary_field(summaries[0]))
            yield writer.DONE
        except (asyncio.CancelledError, GeneratorExit):
            status = 499  # the client went away: free everything the request held
            raise
        finally:
            self._abort_all()
            self.metrics.add_returned_tokens(returned)
            with contextlib.suppress(Exception):
                self._account(status)
