"""Per-request and per-choice state owned by the engine, and turning a request into prompt tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from runtime.grammar.tools import template_inputs, tool_format_of
from runtime.model.detokenizer import IncrementalDetokenizer
from runtime.wire.params import SamplingParams
from runtime.wire.protocol import (
    DetokenizeRequest, Detokenized, GenerateRequest, PromptLogprob, RankedLogprob, RequestError, TokenizeRequest,
    Tokenized, TokenLogprob, TopLogprob,
)
from runtime.model.sampler import SamplingState, ScoredToken
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


class ChoiceEvents(Protocol):
    """Where a choice's logits and sampled tokens are handled (`runtime.requests.plain.PlainRequests`)."""

    def on_logits(self, choice: "ChoiceState", seq: Sequence) -> list[Sequence]: ...

    def on_sampled(self, choice: "ChoiceState", out) -> None: ...


@dataclass
class ChoiceState:
    """One choice of a plain request, and the owner of its sequence (`runtime.kv.sequence_owner`)."""

    request: "RequestState"
    index: int
    sampling: SamplingState
    detok: IncrementalDetokenizer
    events: ChoiceEvents = field(repr=False, compare=False)
    seq: Sequence | None = None
    finish_reason: str | None = None
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_token_ids: list[int] = field(default_factory=list)
    has_started: bool = False  # its first Delta (which carries the echoed prompt) was sent
    has_ended: bool = False  # its finishing Delta was sent

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens if self.seq is not None else 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def on_logits(self, seq: Sequence, row) -> list[Sequence]:
        return self.events.on_logits(self, seq)

    def on_sampled(self, seq: Sequence, out) -> None:
        self.events.on_sampled(self, out)


@dataclass
class RequestState:
    request_id: str
    params: SamplingParams
    prompt_ids: list[int]
    max_tokens: int
    choices: list[ChoiceState] = field(default_factory=list)
    is_forked: bool = False
    num_cached_tokens: int = 0
    prompt_text: str | None = None  # echo: the prompt as the client sent it (or its ids decoded)
    # Prompt logprobs (params.prompt_logprobs): the score of the token at each position (None at 0), and
    # how many positions from the start have had their logits computed, without a gap (the prefix
    # cache's reuse is undone when it would leave one: runtime.requests.plain).
    prompt_scores: list[ScoredToken | None] = field(default_factory=list)
    num_scored_positions: int = 0
    _prompt_logprobs: tuple[PromptLogprob, ...] | None = None

    @property
    def is_finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def is_scoring_prompt(self) -> bool:
        """Prompt logprobs were asked for and some position's logits are still to come (the last prompt
        position's logits score the first generated token, not a prompt token)."""
        return self.params.prompt_logprobs is not None and self.num_scored_positions < len(self.prompt_ids) - 1

    def prompt_logprobs(self, tokenizer) -> tuple[PromptLogprob, ...] | None:
        """Every prompt token's score on the wire, built once the prompt was computed."""
        if self.params.prompt_logprobs is None:
            return None
        if self._prompt_logprobs is None:
            out = []
            for position, token_id in enumerate(self.prompt_ids):
                scored = self.prompt_scores[position] if position < len(self.prompt_scores) else None
                if scored is None:
                    out.append(PromptLogprob(token_id, tokenizer.decode([token_id])))
                    continue
                top = tuple(RankedLogprob(tid, tokenizer.decode([tid]), lp, rank)
                            for rank, (tid, lp) in enumerate(scored.top, start=1))
                out.append(PromptLogprob(token_id, tokenizer.decode([token_id]), scored.logprob, scored.rank, top))
            self._prompt_logprobs = tuple(out)
        return self._prompt_logprobs


def prompt_token_ids(request: GenerateRequest, tokenizer) -> list[int]:
    """Tokenize the request's messages (with the chat template), prompt text, or take its ids."""
    if request.messages is not None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise InvalidRequest("this model has no chat template; use /v1/completions", "messages")
        _, renders_tools = tool_format_of(tokenizer.chat_template)
        messages, tools = template_inputs(list(request.messages), request.tools, renders_tools)
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                                 **request.chat_template_kwargs)
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
        users = [m.get("content") or "" for m in request.messages if m.get("role") == "user"]
        return users[-1] if users else ""
    return request.prompt or ""


def answer_form_of(request: GenerateRequest, tool_format: str) -> str | None:
    """How a search's answers to `request` compare (runtime.search.answers.structured_answer): as JSON,
    as tool calls, as plain text (a regex, a choice, a grammar), or None: as mathematical answers."""
    if request.tools is not None:
        return f"tools:{tool_format}"
    if request.constraint is None:
        return None
    return "json" if request.constraint.kind in ("json_object", "json_schema") else "text"


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


def tokenize(request: TokenizeRequest, tokenizer, max_model_len: int) -> Tokenized | RequestError:
    """/tokenize: a prompt text, or messages through the chat template, as the generation path tokenizes them."""
    try:
        if request.messages is not None:
            if getattr(tokenizer, "chat_template", None) is None:
                raise InvalidRequest("this model has no chat template", "messages")
            _, renders_tools = tool_format_of(tokenizer.chat_template)
            try:
                messages, tools = template_inputs(list(request.messages), request.tools, renders_tools)
                text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                     add_generation_prompt=request.add_generation_prompt,
                                                     **request.chat_template_kwargs)
            except Exception as exc:  # noqa: BLE001 - templates raise arbitrary errors on bad input
                raise InvalidRequest(f"the chat template rejected these messages: {exc}", "messages") from None
        elif request.prompt is not None:
            text = request.prompt
        else:
            raise InvalidRequest("a request needs messages or a prompt", "prompt")
        ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    except InvalidRequest as err:
        return err.to_message(request.request_id)
    return Tokenized(request_id=request.request_id, token_ids=tuple(ids), max_model_len=max_model_len)


def detokenize(request: DetokenizeRequest, tokenizer, vocab_size: int) -> Detokenized | RequestError:
    if any(not 0 <= t < vocab_size for t in request.token_ids):
        return InvalidRequest(f"token ids must lie in [0, {vocab_size})", "tokens").to_message(request.request_id)
    try:
        text = tokenizer.decode(list(request.token_ids))
    except Exception as exc:  # noqa: BLE001 - a tokenizer's own refusal is the client's input error
        return InvalidRequest(f"these token ids cannot be decoded: {exc}", "tokens").to_message(request.request_id)
    return Detokenized(request_id=request.request_id, text=text)
