"""Turning runtime messages into OpenAI responses and stream chunks (chat and text completions)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from runtime.protocol import Delta, Finished, SearchSummary, StepScore, TokenLogprob


def chat_logprobs(items: list[TokenLogprob]) -> dict:
    return {"content": [
        {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes),
         "top_logprobs": [{"token": x.token, "logprob": x.logprob, "bytes": list(x.bytes)} for x in t.top]}
        for t in items]}


def completion_logprobs(items: list[TokenLogprob], text_start: int = 0) -> dict:
    offsets, offset = [], text_start
    for t in items:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{x.token: x.logprob for x in t.top} for t in items], "text_offset": offsets}


def usage(finished: list[Finished]) -> dict:
    prompt = sum(f.prompt_tokens for f in finished)
    completion = sum(f.completion_tokens for f in finished)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in finished)}}


@dataclass
class ChoiceText:
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    search: StepScore | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.num_tokens += len(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        if delta.search is not None:
            self.search = delta.search


def search_field(score: StepScore | None) -> dict | None:
    if score is None:
        return None
    return {"score": score.score, "step_scores": list(score.step_scores), "answer": score.answer}


def summary_field(summary: SearchSummary | None) -> dict | None:
    if summary is None:
        return None
    return {f: getattr(summary, f) for f in summary.__struct_fields__}


class ChunkWriter:
    """SSE framing for one streamed response: same id and created time on every chunk."""

    def __init__(self, response_id: str, created: int, model: str, is_chat: bool, include_usage: bool) -> None:
        self.id = response_id
        self.created = created
        self.model = model
        self.is_chat = is_chat
        self.include_usage = include_usage
        self.object = "chat.completion.chunk" if is_chat else "text_completion"

    @staticmethod
    def event(payload: dict | str) -> bytes:
        data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"data: {data}\n\n".encode()

    def chunk(self, choices: list[dict], **extra) -> bytes:
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices}
        if self.include_usage:
            body["usage"] = None
        body.update(extra)
        return self.event(body)

    def role_chunk(self, index: int) -> bytes:
        return self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}])

    def delta_chunk(self, delta: Delta, text_offset: int = 0) -> bytes:
        logprobs = None
        if delta.logprobs:
            logprobs = (chat_logprobs(list(delta.logprobs)) if self.is_chat
                        else completion_logprobs(list(delta.logprobs), text_offset))
        choice: dict = {"index": delta.index, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        if self.is_chat:
            choice["delta"] = {"content": delta.text} if delta.text else {}
        else:
            choice["text"] = delta.text
        if delta.search is not None:
            choice["search"] = search_field(delta.search)
        return self.chunk([choice])

    def usage_chunk(self, finished: list[Finished]) -> bytes:
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [], "usage": usage(finished)}
        return self.event(body)

    @staticmethod
    def error(status: int, message: str, type: str, code: str | None = None) -> bytes:
        return ChunkWriter.event({"error": {"message": message, "type": type, "param": None, "code": code}})

    DONE = b"data: [DONE]\n\n"
