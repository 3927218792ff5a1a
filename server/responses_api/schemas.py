"""OpenAI's Responses request body (`POST /v1/responses`) and its translation into the chat request the
chat route runs.

Input items: messages (input_text / output_text / refusal parts), function_call, function_call_output,
and reasoning items (the next assistant message's `reasoning_content`, rendered as a chat request's is:
most chat templates drop earlier reasoning). Built-in tools (web search,
file search, computer use, code interpreter, ...), `background`, stored prompts and conversations are
400s naming them; so is any field this module does not know.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from server.bodies import Body
from server.errors import APIError
from server.schemas import MAX_LOGPROBS, ChatCompletionRequest, SearchRequest
from server.structured import _openai_name


class _Strict(Body):
    model_config = ConfigDict(extra="forbid")


class FunctionTool(Body):
    """A function tool; the built-in ones carry their own `type` and are refused by name."""

    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # a call is always held to its parameters (the chat path's tool grammar)


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(_Strict):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None  # no obfuscation padding is sent either way


LOGPROBS = "message.output_text.logprobs"  # the one `include` served: each output token's logprobs

# Fields of OpenAI's request that ponder cannot obey: a 400 naming the field when set.
REFUSED = {
    "background": "background responses are not supported: the request answers when it is done",
    "background_options": "background responses are not supported",
    "conversation": "conversations are not supported: chain responses with previous_response_id",
    "prompt": "stored prompt templates are not supported",
    "context_management": "context management (compaction) is not supported",
    "access_programs": "access programs are not supported",
    "image": "image generation is not supported",
    "moderation": "moderation is not supported",
    "max_tool_calls": "max_tool_calls is not supported",
}


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    include: list[str] | None = None  # "message.output_text.logprobs" only
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # with the logprobs included
    reasoning: Reasoning | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # Accepted and ignored: caching, routing and attribution (ponder caches every prefix it can, has one tier)
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    # ponder's own (the SDK's extra_body): tree search, top_k and a seed
    search: SearchRequest | None = None
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    # Refused (REFUSED): typed loosely so that any value reaches the refusal naming the field
    background: Any = None
    background_options: Any = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    access_programs: Any = None
    image: Any = None
    moderation: Any = None
    max_tool_calls: Any = None

    def check(self) -> None:
        """APIError naming the first field set that this server cannot obey."""
        for name, why in REFUSED.items():
            value = getattr(self, name)
            if value is not None and value is not False:
                raise APIError(400, why, name)
        for index, what in enumerate(self.include or ()):
            if what != LOGPROBS:
                raise APIError(400, f"include {what!r} is not supported: only {LOGPROBS!r} is", f"include.{index}")
        if self.reasoning is not None and (self.reasoning.effort not in (None, "none") or self.reasoning.summary):
            raise APIError(400, "reasoning effort and summaries are not supported: ask for more thought with the "
                                "`search` extension", "reasoning")
        if self.truncation == "auto":
            raise APIError(400, "truncation auto is not supported: an input over the context is a 400", "truncation")
        if self.text is not None and self.text.verbosity is not None:
            raise APIError(400, "verbosity is not supported", "text.verbosity")

    def input_items(self) -> list[dict[str, Any]]:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return list(self.input)

    def to_chat(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request for `history` (the items of the previous responses, then this input)."""
        self.check()
        messages = [{"role": "system", "content": self.instructions}] \
            if self.instructions else []
        messages += chat_messages(history, "input")
        fields: dict[str, Any] = {"model": self.model, "messages": messages}
        fields.update(self._tools())
        for name in ("temperature", "top_p", "top_k", "seed", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            fields["max_tokens"] = self.max_output_tokens
        if LOGPROBS in (self.include or ()):
            fields["logprobs"] = True
            fields["top_logprobs"] = self.top_logprobs or 0
        if self.text is not None and self.text.format is not None and self.text.format.type != "text":
            if fields.get("tools") and fields.get("tool_choice") != "none":
                raise APIError(400, "tools that may be called cannot be combined with a json format (set "
                                    "tool_choice to none, or leave the format out)", "text.format")
            fmt = self.text.format
            if fmt.type == "json_object":
                fields["response_format"] = {"type": "json_object"}
            else:
                if not fmt.name or fmt.schema_ is None:
                    raise APIError(400, "a json_schema format needs a name and a schema",
                                   "text.format.name" if not fmt.name else "text.format.schema")
                fields["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
        if self.search is not None:
            fields["search"] = self.search.model_dump(exclude_unset=True)
        if self.stream:
            fields["stream"] = True
            fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as exc:
            error = exc.errors()[0]
            loc = ".".join(map(str, error["loc"]))
            param = {"response_format": "text.format"}.get(loc.split(".")[0], loc)
            raise APIError(400, f"{param}: {error['msg']}", param) from None

    def _tools(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        names: set[str] = set()
        if self.tools:
            tools = []
            for index, tool in enumerate(self.tools):
                if tool.type != "function":
                    raise APIError(400, f"the built-in tool {tool.type!r} is not supported: only function tools "
                                        "are", f"tools.{index}.type")
                if tool.model_extra:
                    raise APIError(400, "Extra inputs are not permitted", f"tools.{index}.{next(iter(tool.model_extra))}")
                if tool.name is None:
                    raise APIError(400, "Field required", f"tools.{index}.name")
                try:
                    _openai_name(tool.name)
                except ValueError as exc:
                    raise APIError(400, str(exc), f"tools.{index}.name") from None
                if tool.parameters is not None and tool.parameters.get("type", "object") != "object":
                    raise APIError(400, "a function's parameters must be a JSON Schema of type object",
                                   f"tools.{index}.parameters")
                function = {"name": tool.name, "parameters": tool.parameters or {"type": "object", "properties": {}}}
                if tool.description is not None:
                    function["description"] = tool.description
                tools.append({"type": "function", "function": function})
                names.add(tool.name)
            fields["tools"] = tools
        choice = self.tool_choice
        if choice is None:
            return fields
        if isinstance(choice, dict):
            raise APIError(400, f"tool_choice of type {choice.get('type')!r} is not supported: give none, auto, "
                                "required or a function", "tool_choice")
        if not self.tools:
            if choice in ("none", "auto"):
                return fields
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        if isinstance(choice, NamedFunction):
            if choice.name not in names:
                raise APIError(400, f"tool_choice names {choice.name!r}, which is not among the tools",
                               "tool_choice.name")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = choice
        return fields


def _text_of(content: Any, param: str) -> str:
    """A message's or an output's text: a string, or text parts (input_text, output_text, refusal)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of parts", param)
    texts = []
    for at, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise APIError(400, f"{kind} parts are not supported (this server's model reads text)",
                           f"{param}.{at}.type")
        else:
            raise APIError(400, "a part must be input_text, output_text or refusal, with its text",
                           f"{param}.{at}")
    return "".join(texts)


def _string(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, "Field required (a string)", f"{param}.{key}")
    return value


def chat_messages(items: list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    """Responses items as chat messages: consecutive function calls join the assistant message before
    them as its tool_calls; a call's output is a tool message."""
    out: list[dict[str, Any]] = []
    reasoning = ""  # a reasoning item's text, for the assistant message after it
    for index, item in enumerate(items):
        where = f"{param}.{index}"
        if not isinstance(item, dict):
            raise APIError(400, "an input item must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, "role must be user, assistant, system or developer", f"{where}.role")
            out.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
            if role == "assistant" and reasoning:
                out[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            try:
                json.loads(call["function"]["arguments"])
            except ValueError:
                raise APIError(400, "arguments must be JSON text", f"{where}.arguments") from None
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if reasoning:
                out[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise APIError(400, "a reasoning item's content and summary are lists of parts with text",
                               f"{where}.content")
            reasoning += "".join(p["text"] for p in parts)
        else:
            raise APIError(400, f"input items of type {kind!r} are not supported: give messages, function_call, "
                                "function_call_output or reasoning items", f"{where}.type")
    return out
