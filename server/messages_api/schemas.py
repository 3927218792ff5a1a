"""Anthropic's Messages request bodies, checked as strictly as Anthropic checks them (an unknown field is
a 400 naming it), and their translation into the chat request the chat route runs.

Content blocks: text, tool_use and thinking in an assistant's turn, text and tool_result in a user's.
A previous turn's thinking goes to the chat path as the message's `reasoning_content`, rendered as a
chat request's is (most chat templates drop earlier reasoning). What ponder cannot
obey (images, documents, server tools, a final assistant message to continue) is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from server.bodies import Body
from server.errors import APIError
from server.schemas import ChatCompletionRequest, SearchRequest
from server.structured import _openai_name


class _Strict(Body):
    model_config = ConfigDict(extra="forbid")


CacheControl = dict[str, Any] | None  # a caching hint: ponder keeps every prefix it can in its prefix cache


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: list[Any] | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(block.text for block in self.content)


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        """A block of another type (image, document, ...) named by its position, not as a failed union."""
        if isinstance(value, list):
            for at, block in enumerate(value):
                kind = block.get("type") if isinstance(block, dict) else None
                if kind not in _BLOCK_TYPES:
                    raise PydanticCustomError("block_type", "block {at} has type {kind}: this server takes "
                                              + ", ".join(_BLOCK_TYPES) + " blocks", {"at": at, "kind": repr(kind)})
        return value


class Tool(Body):
    """A client tool (`type` absent or custom). Anthropic's server tools (web search, bash, code execution,
    computer use, text editor) carry a versioned `type` and are refused by name."""

    model_config = ConfigDict(extra="allow")

    type: str | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: CacheControl = None
    strict: bool | None = None  # a call is always held to its input_schema (the chat path's tool grammar)
    eager_input_streaming: bool | None = None  # a call streams once it is whole, whichever


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=0)
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: JsonOutputFormat | None = None  # structured outputs: the chat path's json_schema grammar
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class Metadata(_Strict):
    user_id: str | None = None


class CountTokensRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's messages and tools; APIError naming what cannot be obeyed."""
        if self.thinking is not None and self.thinking.type != "disabled":
            raise APIError(400, f"thinking of type {self.thinking.type} is not supported by this server's model",
                           "thinking.type")
        if self.messages[-1].role == "assistant":
            raise APIError(400, "a final assistant message (a prefill to continue) is not supported; end with a "
                                "user message", f"messages.{len(self.messages) - 1}.role")
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": self.system if isinstance(self.system, str)
                             else "".join(block.text for block in self.system)})
        for index, message in enumerate(self.messages):
            messages.extend(_chat_messages(message, index))
        fields: dict[str, Any] = {"model": self.model, "messages": messages}
        fields.update(self._tools())
        return fields

    def _tools(self) -> dict[str, Any]:
        if self.tools is None:
            if self.tool_choice is not None and self.tool_choice.type != "none":
                raise APIError(400, "tool_choice needs tools", "tool_choice")
            return {}
        tools = []
        for index, tool in enumerate(self.tools):
            if tool.type not in (None, "custom"):
                raise APIError(400, f"the server tool {tool.type!r} is not supported: only client tools (a name "
                                    "and an input_schema) are", f"tools.{index}.type")
            if tool.model_extra:
                extra = next(iter(tool.model_extra))
                raise APIError(400, "Extra inputs are not permitted", f"tools.{index}.{extra}")
            if tool.input_schema is None:
                raise APIError(400, "Field required", f"tools.{index}.input_schema")
            if tool.input_schema.get("type", "object") != "object":
                raise APIError(400, "a tool's input_schema must be a JSON Schema of type object",
                               f"tools.{index}.input_schema")
            try:
                _openai_name(tool.name)
            except ValueError as exc:
                raise APIError(400, str(exc), f"tools.{index}.name") from None
            function = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description is not None:
                function["description"] = tool.description
            tools.append({"type": "function", "function": function})
        choice = self.tool_choice
        fields: dict[str, Any] = {"tools": tools}
        if choice is None:
            return fields
        if choice.type == "tool":
            if choice.name is None:
                raise APIError(400, "Field required", "tool_choice.name")
            if choice.name not in {t.name for t in self.tools}:
                raise APIError(400, f"tool_choice names {choice.name!r}, which is not among the tools",
                               "tool_choice.name")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
        return fields

    def to_chat(self) -> ChatCompletionRequest:
        return _chat_request(self.chat_fields())


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    # Accepted and ignored: routing, caching and attribution (ponder caches every prefix it can, has one
    # tier, one place, one speed)
    cache_control: CacheControl = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # Refused (a 400 naming them): code-execution containers, prompt-cache diagnostics
    container: Any = None
    diagnostics: Any = None
    # ponder's own (the SDKs' extra_body): tree search over the answer, and a seed
    search: SearchRequest | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty(cls, value):
        if value is not None and not all(value):
            raise ValueError("stop sequences must not be empty strings")
        return value

    def to_chat(self) -> ChatCompletionRequest:
        for name in ("container", "diagnostics"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name} is not supported by this server", name)
        fields = self.chat_fields()
        fields["max_tokens"] = self.max_tokens
        if self.output_config is not None and self.output_config.effort is not None:
            raise APIError(400, "effort is not supported: ask for more thought with the `search` extension",
                           "output_config.effort")
        if self.output_config is not None and self.output_config.format is not None:
            if fields.get("tools") and fields.get("tool_choice") != "none":
                raise APIError(400, "tools that may be called cannot be combined with a format (set tool_choice "
                                    "to none, or leave the format out)", "output_config.format")
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.schema_}}
        for name in ("temperature", "top_p", "top_k", "seed"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.stop_sequences:
            # Anthropic names the stop sequence met: the text keeps it, and the answer strips it (output.py).
            fields["stop"] = self.stop_sequences
            fields["include_stop_str_in_output"] = True
        if self.metadata is not None and self.metadata.user_id is not None:
            fields["user"] = self.metadata.user_id
        if self.search is not None:
            fields["search"] = self.search.model_dump(exclude_unset=True)
        if self.stream:
            fields["stream"] = True
            # every chunk carries the usage so far: message_start reports the prompt's tokens
            fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return _chat_request(fields)


def _chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # the checks above should leave nothing; still a 400, never a 500
        error = exc.errors()[0]
        raise APIError(400, f"{'.'.join(map(str, error['loc']))}: {error['msg']}") from None


# The blocks each role may send
_ALLOWED = {"user": (TextBlock, ToolResultBlock),
            "assistant": (TextBlock, ToolUseBlock, ThinkingBlock, RedactedThinkingBlock)}


def _chat_messages(message: Message, index: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results become tool messages (before its
    text, as Anthropic orders them); an assistant's tool_use blocks become its tool_calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    for at, block in enumerate(message.content):
        if not isinstance(block, _ALLOWED[message.role]):
            raise APIError(400, f"a {message.role} message cannot hold a {block.type} block",
                           f"messages.{index}.content.{at}.type")
    texts = [{"type": "text", "text": b.text} for b in message.content if isinstance(b, TextBlock)]
    if message.role == "user":
        out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                                     for b in message.content if isinstance(b, ToolResultBlock)]
        if texts or not out:
            out.append({"role": "user", "content": texts})
        return out
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in message.content if isinstance(b, ToolUseBlock)]
    chat: dict[str, Any] = {"role": "assistant", "content": texts or None}
    if calls:
        chat["tool_calls"] = calls
    thinking = "".join(b.thinking for b in message.content if isinstance(b, ThinkingBlock))
    if thinking:
        chat["reasoning_content"] = thinking
    return [chat]
