"""Turning runtime messages into OpenAI responses and stream chunks (chat and text completions)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from runtime.wire.protocol import Delta, Finished, PromptLogprob, SearchSummary, StepScore, TokenLogprob


@dataclass(frozen=True)
class PromptAsks:
    """What a request asked of its prompt: echoed logprobs with this many top entries (completions'
    echo + logprobs), vLLM's prompt_logprobs with this many, and continuous usage in stream chunks."""

    echo_logprobs: int | None = None
    prompt_logprobs: int | None = None
    continuous_usage: bool = False


def chat_logprobs(items: list[TokenLogprob]) -> dict:
    return {"content": [
        {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes),
         "top_logprobs": [{"token": x.token, "logprob": x.logprob, "bytes": list(x.bytes)} for x in t.top]}
        for t in items]}


def completion_logprobs(items: list[TokenLogprob], text_start: int = 0,
                        prompt: tuple[PromptLogprob, ...] = (), prompt_top: int = 0) -> dict:
    """OpenAI's completion logprobs over `items`, after the echoed `prompt` tokens when given: the first
    prompt token has a null logprob and null top_logprobs; the others carry their `prompt_top` most likely
    tokens and themselves (as vLLM does)."""
    tokens = [p.token for p in prompt] + [t.token for t in items]
    logprobs = [p.logprob for p in prompt] + [t.logprob for t in items]
    tops: list[dict | None] = [None if p.logprob is None else
                               {**{x.token: x.logprob for x in p.top[:prompt_top]}, p.token: p.logprob}
                               for p in prompt]
    tops += [{x.token: x.logprob for x in t.top} for t in items]
    offsets, offset = [], text_start
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_field(prompt: tuple[PromptLogprob, ...], k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: null for the first token, then {token id: {logprob, rank, decoded_token}} with
    the `k` most likely tokens at that position and the prompt token itself."""
    out: list[dict | None] = []
    for p in prompt:
        if p.logprob is None:
            out.append(None)
            continue
        entry = {str(x.token_id): {"logprob": x.logprob, "rank": x.rank, "decoded_token": x.token} for x in p.top[:k]}
        entry[str(p.token_id)] = {"logprob": p.logprob, "rank": p.rank, "decoded_token": p.token}
        out.append(entry)
    return out


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage(finished: list[Finished]) -> dict:
    prompt = sum(f.prompt_tokens for f in finished)
    completion = sum(f.completion_tokens for f in finished)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in finished)}}
    counted = [f.reasoning_tokens for f in finished if f.reasoning_tokens is not None]
    if counted:  # a thinking model's chat answer: of its completion tokens, the thinking ones
        out["completion_tokens_details"] = {"reasoning_tokens": sum(counted)}
    return out


@dataclass
class ChoiceText:
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    search: StepScore | None = None
    prompt_logprobs: tuple[PromptLogprob, ...] = ()

    def add(self, delta: Delta) -> None:
        if delta.prompt_text is not None:  # echo: on the choice's first delta
            self.text += delta.prompt_text
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
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

    def __init__(self, response_id: str, created: int, model: str, is_chat: bool, include_usage: bool,
                 asks: PromptAsks = PromptAsks()) -> None:
        self.id = response_id
        self.created = created
        self.model = model
        self.is_chat = is_chat
        self.include_usage = include_usage
        self.asks = asks
        self.object = "chat.completion.chunk" if is_chat else "text_completion"
        # continuous_usage_stats: the usage so far, on every chunk (the caller counts)
        self.prompt_tokens = 0
        self.completion_tokens = 0

    @staticmethod
    def event(payload: dict | str) -> bytes:
        data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"data: {data}\n\n".encode()

    def chunk(self, choices: list[dict], **extra) -> bytes:
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices}
        if self.include_usage:
            body["usage"] = running_usage(self.prompt_tokens, self.completion_tokens) \
                if self.asks.continuous_usage else None
        body.update(extra)
        return self.event(body)

    def role_chunk(self, index: int) -> bytes:
        return self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}])

    def delta_chunk(self, delta: Delta, text_offset: int = 0, tool_calls=None, thinking=None) -> bytes:
        """`tool_calls`: a `server.tool_output.ToolCalls` when the request offered tools; `thinking`: a
        `server.reasoning_output.Thinking` when the model thinks in its text."""
        logprobs = None
        asks = self.asks
        echoed = delta.prompt_logprobs if asks.echo_logprobs is not None and delta.prompt_logprobs else ()
        if delta.logprobs or echoed:
            logprobs = (chat_logprobs(list(delta.logprobs or ())) if self.is_chat
                        else completion_logprobs(list(delta.logprobs or ()), text_offset, echoed,
                                                 asks.echo_logprobs or 0))
        choice: dict = {"index": delta.index, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        text, thought = delta.text, ""
        if self.is_chat and thinking is not None:
            thought, text = thinking.delta(delta.index, delta.text, delta.finish_reason is not None)
        if self.is_chat and tool_calls is not None:
            choice["delta"], choice["finish_reason"] = tool_calls.delta(delta.index, text, delta.finish_reason)
        elif self.is_chat:
            choice["delta"] = {"content": text} if text else {}
        if thought:  # ahead of the content, as vLLM sends it
            choice["delta"] = {**thinking.fields(thought), **choice["delta"]}
        else:
            choice["text"] = (delta.prompt_text or "") + delta.text
        if asks.prompt_logprobs is not None and delta.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_field(delta.prompt_logprobs, asks.prompt_logprobs)
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
