"""Per-request and per-choice state owned by the engine, and turning a request into prompt tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.detokenizer import IncrementalDetokenizer
from runtime.protocol import GenerateRequest, RequestError, SamplingParams, TokenLogprob, TopLogprob
from runtime.sampler import SamplingState
from scheduler.sequence import Sequence


class InvalidRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code

    def to_message(self, request_id: str) -> RequestError:
        return RequestError(request_id=request_id, status=self.status, message=str(self),
                            param=self.param, code=self.code)


@dataclass
class ChoiceState:
    request: "RequestState"
    index: int
    sampling: SamplingState
    detok: IncrementalDetokenizer
    seq: Sequence | None = None
    finish_reason: str | None = None
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_token_ids: list[int] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens if self.seq is not None else 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def on_logits(self, engine, seq: Sequence, row) -> list[Sequence]:
        return engine.plain.on_logits(self, seq)

    def on_sampled(self, engine, seq: Sequence, out) -> None:
        engine.plain.on_sampled(self, out)


@dataclass
class RequestState:
    request_id: str
    params: SamplingParams
    prompt_ids: list[int]
    max_tokens: int
    choices: list[ChoiceState] = field(default_factory=list)
    is_forked: bool = False
    num_cached_tokens: int = 0

    @property
    def is_finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)


def prompt_token_ids(request: GenerateRequest, tokenizer) -> list[int]:
    """Tokenize the request's messages (with the chat template), prompt text, or take its ids."""
    if request.messages is not None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise InvalidRequest("this model has no chat template; use /v1/completions", "messages")
        try:
            text = tokenizer.apply_chat_template(list(request.messages), add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - templates raise arbitrary errors on bad input
            raise InvalidRequest(f"the chat template rejected these messages: {exc}", "messages") from None
        return list(tokenizer.encode(text, add_special_tokens=False))
    if request.prompt is not None:
        return list(tokenizer.encode(request.prompt, add_special_tokens=True))
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    raise InvalidRequest("a request needs messages or a prompt", "prompt")


def question_of(request: GenerateRequest) -> str:
    """The problem a verifier is shown: the last user message, or the prompt text."""
    if request.messages is not None:
        users = [m.get("content", "") for m in request.messages if m.get("role") == "user"]
        return users[-1] if users else ""
    return request.prompt or ""


def token_logprob(tokenizer, token_id: int, logprob: float, top: list[tuple[int, float]] | None) -> TokenLogprob:
    def entry(tid: int) -> tuple[str, tuple[int, ...]]:
        text = tokenizer.decode([tid])
        return text, tuple(text.encode("utf-8"))

    tops = []
    for tid, lp in top or []:
        top_text, top_raw = entry(tid)
        tops.append(TopLogprob(top_text, lp, top_raw))
    text, raw = entry(token_id)
    return TokenLogprob(text, logprob, raw, tuple(tops))
