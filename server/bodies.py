"""What every request body is made of: fields checked to cross to the runtime (msgpack), and chat
messages. The OpenAI endpoints' bodies (server.schemas), the Responses and Messages APIs' and the
non-generating ones (server.non_openai_schemas) are built of these.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator


class WireFields(BaseModel):
    """Fields cross to the runtime as msgpack: strings must encode as UTF-8 (a JSON escape can carry a
    lone surrogate) and integers must fit in 64 bits. Anything else is a 400 here, not a failure later."""

    @field_validator("*")
    @classmethod
    def _fits_the_wire(cls, value: Any) -> Any:
        check_wire_value(value)
        return value


def check_wire_value(value: Any) -> None:
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
            check_wire_value(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_wire_value(key)
            check_wire_value(item)


class Body(WireFields):
    """A request body, or a part of one: checked for the wire; undeclared fields kept for server.extras."""

    model_config = ConfigDict(extra="allow")


class TextPart(Body):
    type: Literal["text"]
    text: str


class CalledFunction(Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Body):
    # "function": the deprecated function-calling API's result message (treated as a tool's)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers
    function_call: CalledFunction | None = None  # deprecated: an assistant's one call
    # An earlier answer sent back as the server gave it: its thinking (vLLM's two names for it) goes to
    # the chat template as `reasoning_content`; OpenAI's response-only fields are accepted and unused.
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def wire(self) -> dict[str, Any]:
        """The message as the runtime's chat template takes it (OpenAI's shape, calls included)."""
        role = "tool" if self.role == "function" else self.role
        out: dict[str, Any] = {"role": role, "content": self.text()}
        calls = [c.model_dump() for c in self.tool_calls or []]
        if self.function_call is not None:
            calls.append({"id": "call_0", "type": "function", "function": self.function_call.model_dump()})
        if calls:
            out["tool_calls"] = calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and role == "tool":
            out["name"] = self.name
        thinking = self.reasoning_content or self.reasoning
        if thinking and role == "assistant":
            out["reasoning_content"] = thinking
        return out
