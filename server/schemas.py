"""Request bodies of the OpenAI endpoints, validated strictly enough that no mistake reaches the runtime.

Unknown top-level fields are ignored (clients send vendor extras); known ones are type-checked.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runtime.wire.protocol import SamplingParams, SearchParams


class _Wire(BaseModel):
    """Fields cross to the runtime as msgpack: strings must encode as UTF-8 (a JSON escape can carry a
    lone surrogate) and integers must fit in 64 bits. Anything else is a 400 here, not a failure later."""

    @field_validator("*")
    @classmethod
    def _fits_the_wire(cls, value: Any) -> Any:
        _check_wire_value(value)
        return value


def _check_wire_value(value: Any) -> None:
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    elif isinstance(value, int) and not -(2**63) <= value < 2**63:
        raise ValueError("integers must lie in [-2**63, 2**63)")
    elif isinstance(value, list):
        for item in value:
            _check_wire_value(item)


class _Body(_Wire):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far (with include_usage)
    include_search_events: bool = False


class SearchRequest(_Wire):
    model_config = ConfigDict(extra="forbid")

    strategy: Literal["best_of_n", "beam", "dvts", "dynamic_branching", "particle_filtering"] = "beam"
    n: int = Field(8, ge=1)
    beam_width: int = Field(4, ge=1)
    max_steps: int = Field(40, ge=1)
    step_delimiter: str = Field("\n\n", min_length=1)
    max_step_tokens: int = Field(256, ge=1)
    granularity: int = Field(1, ge=1)
    lookahead: int = Field(0, ge=0)
    verifier: str = "calculator"
    aggregation: Literal["last", "min", "prod", "mean"] = "last"
    select: Literal["best", "majority", "weighted_majority"] = "best"
    answer_pattern: str | None = None
    # Seconds the search may run before it answers with the best path found so far; None: the server's cap.
    timeout_s: float | None = None
    # One more path decoded greedily, the answer unless a candidate outranks it (docs/search-greedy-anchor.md).
    greedy_anchor: bool = True

    def to_params(self, include_events: bool, default_timeout_s: float) -> SearchParams:
        fields = self.model_dump()
        fields["timeout_s"] = default_timeout_s if self.timeout_s is None else self.timeout_s
        return SearchParams(**fields, include_events=include_events)


MAX_LOGPROBS = 20  # the most top logprobs a position may ask for (logprobs, top_logprobs, prompt_logprobs)

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Generation(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extras (OpenAI SDK: extra_body)
    top_k: int = Field(0, ge=-1)
    min_p: Probability = 0.0
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    # vLLM: each prompt token's logprob, rank and this many most likely tokens at its position
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    search: SearchRequest | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        return self.stop or []  # type: ignore[return-value]

    def sampling(self, max_tokens: int | None, logprobs: bool, top_logprobs: int, echo: bool = False,
                 prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=0 if self.top_k == -1 else self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=tuple(self.stop_list()),
            stop_token_ids=tuple(self.stop_token_ids), include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, logprobs=logprobs, top_logprobs=top_logprobs, n=self.n, echo=echo,
            prompt_logprobs=prompt_logprobs)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def to_sampling(self) -> SamplingParams:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling(limit, self.logprobs, self.top_logprobs or 0, prompt_logprobs=self.prompt_logprobs)

    def wire_messages(self) -> tuple[dict[str, str], ...]:
        return tuple({"role": m.role, "content": m.text()} for m in self.messages)


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: the prompt alone, with echo or prompt_logprobs
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the text starts with the prompt; with logprobs, the logprobs cover the prompt too
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: Any):
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        return value

    @model_validator(mode="after")
    def _unsupported(self):
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    @property
    def echo_logprobs(self) -> int | None:
        """The top logprobs each echoed prompt token carries, or None when the prompt's are not asked for."""
        return self.logprobs if self.echo else None

    def to_sampling(self) -> SamplingParams:
        wants = self.logprobs is not None
        asks = [k for k in (self.echo_logprobs, self.prompt_logprobs) if k is not None]
        return self.sampling(self.max_tokens, wants, self.logprobs or 0, echo=self.echo,
                             prompt_logprobs=max(asks) if asks else None)


class TokenizeBody(_Body):
    """vLLM's /tokenize: a prompt, or messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (as vLLM)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self

    def wire_messages(self) -> tuple[dict[str, str], ...] | None:
        if self.messages is None:
            return None
        return tuple({"role": m.role, "content": m.text()} for m in self.messages)


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[int]
