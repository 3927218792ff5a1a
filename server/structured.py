"""The fields that shape an output: response_format, vLLM's structured_outputs (and its older guided_*
names), tools and tool_choice (and the deprecated functions and function_call), logit_bias.

Each becomes the wire's `Constraint` or `ToolCalling`, which the runtime compiles (runtime.grammar);
what cannot be obeyed is a 400 naming the field, never ignored.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runtime.wire.params import Constraint, ToolCalling

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function and schema names


def _openai_name(value: str) -> str:
    if not _NAME.match(value):
        raise ValueError("must be 1-64 letters, digits, underscores or dashes")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # `schema` shadows a BaseModel attribute: held as schema_ and read from "schema"
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    _name = field_validator("name")(classmethod(lambda cls, value: _openai_name(value)))


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (extra_body): exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar and json_object")
        return self


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    _name = field_validator("name")(classmethod(lambda cls, value: _openai_name(value)))

    @field_validator("parameters")
    @classmethod
    def _object(cls, value):
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("a function's parameters must be a JSON Schema of type object")
        return value


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _json_text(value: dict[str, Any] | str, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{param} is not valid JSON: {exc}") from None
    return json.dumps(value)


def constraint_of(response_format: ResponseFormat | None, structured: StructuredOutputs | None,
                  guided: dict[str, Any]) -> Constraint | None:
    """The one output constraint a request asks for, by whichever spelling; ValueError if several."""
    asked = []
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            asked.append(Constraint(kind="json_object", param="response_format"))
        else:
            schema = response_format.json_schema.schema_  # type: ignore[union-attr]
            asked.append(Constraint(kind="json_schema", spec=json.dumps(schema),
                                    param="response_format.json_schema.schema"))
    if structured is not None:
        asked.append(_from_structured(structured.json_, structured.regex, structured.choice, structured.grammar,
                                      bool(structured.json_object), "structured_outputs"))
    if any(v is not None for v in guided.values()):
        given = [k for k, v in guided.items() if v is not None]
        if len(given) > 1:
            raise ValueError(f"give one of {', '.join(given)}")
        asked.append(_from_structured(guided["guided_json"], guided["guided_regex"], guided["guided_choice"],
                                      guided["guided_grammar"], False, None))
    if len(asked) > 1:
        raise ValueError("give one of response_format, structured_outputs and the guided_* fields")
    return asked[0] if asked else None


def _from_structured(schema, regex, choice, grammar, json_object: bool, prefix: str | None) -> Constraint:
    def param(name: str) -> str:
        return f"{prefix}.{name}" if prefix else f"guided_{name}"

    if schema is not None:
        return Constraint(kind="json_schema", spec=_json_text(schema, param("json")), param=param("json"))
    if regex is not None:
        return Constraint(kind="regex", spec=regex, param=param("regex"))
    if choice is not None:
        if not choice or not all(isinstance(c, str) and c for c in choice):
            raise ValueError(f"{param('choice')} must be a list of non-empty strings")
        return Constraint(kind="choice", spec=json.dumps(choice), param=param("choice"))
    if grammar is not None:
        return Constraint(kind="grammar", spec=grammar, param=param("grammar"))
    assert json_object
    return Constraint(kind="json_object", param=param("json_object"))


def tool_calling_of(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool) -> ToolCalling | None:
    """The wire's ToolCalling, or None (no tools, or tool_choice none); ValueError naming what is wrong."""
    if choice is not None and not tools:
        raise ValueError("tool_choice needs tools")
    if not tools:
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be distinct")
    choice = choice or "auto"
    if choice == "none":
        return None
    definitions = tuple({"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        return ToolCalling(tools=definitions, choice="function", name=choice.function.name, parallel=False)
    return ToolCalling(tools=definitions, choice=choice, parallel=parallel)
