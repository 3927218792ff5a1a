"""Request bodies of the OpenAI endpoints, validated strictly enough that no mistake reaches the runtime.

Known fields are type-checked; fields no schema declares are held (`extra="allow"`) for server.extras,
which refuses them or logs them, never ignores them in silence. What they are made of (the wire
checks, chat messages) is server.bodies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
from pydantic import AfterValidator, ConfigDict, Field, field_validator, model_validator

from runtime.wire.params import Constraint, SamplingParams, SearchParams, ToolCalling
from runtime.wire.protocol import check_template_kwargs
from server.bodies import Body, ChatMessage, WireFields
from server.structured import (
    FunctionDefinition, NamedFunction, NamedToolChoice, ResponseFormat, StructuredOutputs, Tool, ToolChoice,
    constraint_of, tool_calling_of,
)


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far (with include_usage)
    include_search_events: bool = False


class SearchRequest(WireFields):
    model_config = ConfigDict(extra="forbid")

    strategy: Literal["best_of_n", "beam", "dvts", "dynamic_branching", "particle_filtering", "deepconf"] = "beam"
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
    # DeepConf's knobs (docs/search-deepconf.md): warm-up traces (None: max(1, n // 4)), the percentage of
    # traces the stopping threshold keeps, the tokens of a group confidence, vote only the top eta %.
    deepconf_warmup: int | None = Field(None, ge=1)
    deepconf_eta: float = Field(10.0, gt=0.0, le=100.0)
    deepconf_window: int = Field(256, ge=1)
    deepconf_keep_top: bool = False

    @field_validator("deepconf_warmup")
    @classmethod
    def _warmup_within_n(cls, value, info):
        n = info.data.get("n")
        if value is not None and n is not None and value > n:
            raise ValueError(f"the warm-up ({value} traces) cannot exceed n ({n})")
        return value

    def to_params(self, include_events: bool, default_timeout_s: float) -> SearchParams:
        fields = self.model_dump()
        fields["timeout_s"] = default_timeout_s if self.timeout_s is None else self.timeout_s
        return SearchParams(**fields, include_events=include_events)


MAX_LOGPROBS = 20  # the most top logprobs a position may ask for (logprobs, top_logprobs, prompt_logprobs)

Probability = Annotated[float, Field(ge=0.0, le=1.0)]

# The fields a model's generation config may give defaults for (Ready.sampling_defaults): each applies
# where the request leaves its field unset; a request that sends one, even at ponder's default, keeps it.
AUTHOR_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
# Fields with a non-null default that a client may send as null (OpenAI marks them nullable).
NULLABLE = frozenset({"temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "stream", "logprobs",
                      "parallel_tool_calls", "top_k", "min_p", "repetition_penalty", "echo", "best_of"})


class _Generation(Body):
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

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """OpenAI's sampling fields are nullable, null meaning the default (as vLLM reads them): a field
        sent as null is treated as not sent, so its default (or the model author's) applies."""
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in NULLABLE):
            return {key: value for key, value in data.items() if not (value is None and key in NULLABLE)}
        return data
    # What the output must match (server.structured): OpenAI's response_format, vLLM's structured_outputs
    # and its older guided_* names.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # Accepted and ignored: metadata for OpenAI's own storage and billing.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prompt_cache_retention: str | None = None  # ponder keeps every prefix it can (its prefix cache)
    prompt_cache_options: dict[str, Any] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value):
        if value is None:
            return value
        for key in value:
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids (integers as strings), not {key!r}")
        return value

    def constraint(self) -> Constraint | None:
        """The one constraint on the output (ValueError if several are given)."""
        return constraint_of(self.response_format, self.structured_outputs,
                             {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                              "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar})

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

    def sampled(self, defaults: Mapping[str, float] = {}) -> dict[str, Any]:
        """The request's temperature, top_p, top_k, min_p and repetition_penalty, each from `defaults`
        (the model author's) where the request did not send it."""
        return {name: defaults[name] if name in defaults and name not in self.model_fields_set else getattr(self, name)
                for name in AUTHOR_DEFAULTED}

    def sampling(self, max_tokens: int | None, logprobs: bool, top_logprobs: int, echo: bool = False,
                 prompt_logprobs: int | None = None, defaults: Mapping[str, float] = {}) -> SamplingParams:
        sampled = self.sampled(defaults)
        top_k = int(sampled.pop("top_k"))
        return SamplingParams(
            max_tokens=max_tokens, **sampled, top_k=0 if top_k == -1 else top_k,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=tuple(self.stop_list()),
            stop_token_ids=tuple(self.stop_token_ids), include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, logprobs=logprobs, top_logprobs=top_logprobs, n=self.n, echo=echo,
            prompt_logprobs=prompt_logprobs,
            logit_bias=tuple(sorted((int(k), v) for k, v in (self.logit_bias or {}).items())))


# OpenAI chat fields ponder cannot obey: a 400 naming the field, never ignored.
REFUSED_CHAT_FIELDS = {
    "audio": "audio output is not supported (this server generates text)",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "verbosity": "verbosity is not supported",
    "moderation": "moderation is not supported",
}


TemplateKwargs = Annotated[dict[str, Any], AfterValidator(lambda value: check_template_kwargs(value) or value)]


# reasoning_effort as a thinking budget (docs/reasoning.md): none and minimal close the block at once.
THINKING_BUDGETS = {"none": 0, "minimal": 0, "low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768, "max": None}


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[FunctionDefinition] | None = None  # deprecated spelling of tools
    function_call: Literal["none", "auto"] | NamedFunction | None = None  # ... and of tool_choice
    modalities: list[Literal["text", "audio"]] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    moderation: Any = None
    # vLLM's, SGLang's and llama-server's: variables for the chat template (`enable_thinking`), over the
    # server's defaults (model.chat_template_kwargs).
    chat_template_kwargs: TemplateKwargs | None = None
    # A thinking model's thinking (docs/reasoning.md): vLLM's include_reasoning false leaves it out of the
    # answer; llama-server's reasoning_format none leaves it in `content`, unparsed.
    include_reasoning: bool = True
    reasoning_format: Literal["auto", "deepseek", "none"] = "auto"
    # The most thinking tokens before the closing text is forced: vLLM's field, or OpenAI's effort by name
    # (THINKING_BUDGETS); one or the other. A model that does not think in its text refuses both.
    thinking_token_budget: int | None = Field(None, ge=0)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    @model_validator(mode="after")
    def _one_budget(self):
        if self.thinking_token_budget is not None and self.reasoning_effort is not None:
            raise ValueError("give thinking_token_budget or reasoning_effort, not both")
        return self

    @property
    def thinking_budget(self) -> tuple[str, int | None]:
        """(the field that set it, the most thinking tokens or None)."""
        if self.reasoning_effort is not None:
            return "reasoning_effort", THINKING_BUDGETS[self.reasoning_effort]
        return "thinking_token_budget", self.thinking_token_budget

    def refused_field(self) -> tuple[str, str] | None:
        """(field, why) for the first field set that this server cannot obey."""
        if self.modalities is not None and self.modalities != ["text"]:
            return "modalities", "only the text modality is supported"
        for name, why in REFUSED_CHAT_FIELDS.items():
            if getattr(self, name) is not None:
                return name, why
        return None

    @property
    def uses_functions(self) -> bool:
        """The deprecated function-calling API: answered as `function_call`, not `tool_calls`."""
        return self.functions is not None

    def tool_calling(self) -> ToolCalling | None:
        """ValueError naming what is wrong; tools and functions are one or the other."""
        if self.functions is not None or self.function_call is not None:
            if self.tools is not None or self.tool_choice is not None:
                raise ValueError("give tools and tool_choice, or the deprecated functions and function_call, not both")
            tools = [Tool(type="function", function=f) for f in self.functions or []]
            choice = NamedToolChoice(type="function", function=self.function_call) \
                if isinstance(self.function_call, NamedFunction) else self.function_call
            return tool_calling_of(tools, choice, parallel=False)
        return tool_calling_of(self.tools, self.tool_choice, self.parallel_tool_calls)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def to_sampling(self, defaults: Mapping[str, float] = {}) -> SamplingParams:
        """The runtime's sampling parameters; `defaults`: the model's sampling defaults (`sampled`)."""
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        params = self.sampling(limit, self.logprobs, self.top_logprobs or 0, prompt_logprobs=self.prompt_logprobs,
                               defaults=defaults)
        return msgspec.structs.replace(params, thinking_token_budget=self.thinking_budget[1])

    def wire_messages(self) -> tuple[dict[str, Any], ...]:
        return tuple(m.wire() for m in self.messages)


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: the prompt alone, with echo or prompt_logprobs
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the text starts with the prompt; with logprobs, the logprobs cover the prompt too
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)  # OpenAI's: obeyed where it equals n (each choice is returned)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value, info):
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported: ask for the best of several with the "
                             "`search` extension (strategy best_of_n)")
        return value

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

    def to_sampling(self, defaults: Mapping[str, float] = {}) -> SamplingParams:
        """The runtime's sampling parameters; `defaults`: the model's sampling defaults (`sampled`)."""
        wants = self.logprobs is not None
        asks = [k for k in (self.echo_logprobs, self.prompt_logprobs) if k is not None]
        return self.sampling(self.max_tokens, wants, self.logprobs or 0, echo=self.echo,
                             prompt_logprobs=max(asks) if asks else None, defaults=defaults)
