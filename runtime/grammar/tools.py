"""Tools in the prompt and in the grammar: how the model is told of them, and what a call must look like.

The model's chat template decides the format (`tool_format_of`): Hermes-style `<tool_call>` blocks
(Qwen 2.5 and 3, Hermes, SmolLM3), Llama 3's bare JSON object with `parameters`, or Mistral's
`[TOOL_CALLS]` followed by a JSON list. A template that never mentions tools gets ponder's own
system block (`TOOL_BLOCK`) describing them in the Hermes format, and earlier calls and results are
written into the conversation in that format too. Turning the text back into `tool_calls` is
`runtime.wire.tool_calls` (text work, shared with the HTTP process).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from runtime.grammar.schema import tightened
from runtime.wire.params import ToolCalling

ToolFormat = Literal["hermes", "llama3_json", "mistral"]

TOOL_BLOCK = """# Tools

You can call functions to help with the user's request. Their signatures, as JSON Schema, are inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object of its name and arguments inside <tool_call></tool_call> tags:
<tool_call>
{{"name": <function name>, "arguments": <arguments as a JSON object>}}
</tool_call>"""


def tool_format_of(chat_template: str | None) -> tuple[ToolFormat, bool]:
    """(the format the model writes calls in, whether its template renders `tools` itself)."""
    template = chat_template or ""
    renders_tools = "tools" in template
    if "[TOOL_CALLS]" in template:
        return "mistral", renders_tools
    if "<tool_call>" in template or not renders_tools:
        return "hermes", renders_tools
    if "<|python_tag|>" in template or "parameters" in template:
        return "llama3_json", renders_tools
    return "hermes", renders_tools


def _call_schema(tool: dict[str, Any], fmt: ToolFormat) -> dict[str, Any]:
    function = tool["function"]
    parameters = tightened(function.get("parameters") or {"type": "object", "properties": {}})
    key = "parameters" if fmt == "llama3_json" else "arguments"
    return {"type": "object", "properties": {"name": {"const": function["name"]}, key: parameters},
            "required": ["name", key], "additionalProperties": False}


def tool_grammar(tools: ToolCalling, fmt: ToolFormat, json_style: dict[str, Any],
                 marker_token: int | None = None) -> str:
    """A Lark grammar (llguidance's dialect) for the output: free text that never starts a call, or
    the calls alone (`required`, a named function), each call's arguments valid for its schema."""
    chosen = [t for t in tools.tools if tools.choice != "function" or t["function"]["name"] == tools.name]
    options = [_call_schema(t, fmt) for t in chosen]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    call = "%json " + json.dumps({**schema, "x-guidance": json_style})
    if fmt == "hermes":
        rules = [f'call: "<tool_call>\\n" {call} "\\n</tool_call>"',
                 'calls: call ("\\n" call)*' if tools.parallel else "calls: call"]
        free = r"TEXT: /(?s:.+)/ & ~/(?s:.*<tool_call>.*)/"
    elif fmt == "llama3_json":
        rules = [f"call: {call}", 'calls: call ("; " call)*' if tools.parallel else "calls: call"]
        free = r"TEXT: /(?s:[^{\s].*)/"
    else:
        marker = f"<[{marker_token}]>" if marker_token is not None else '"[TOOL_CALLS]"'
        rules = [f"call: {call}", f'calls: {marker} "[" call (", " call)* "]"' if tools.parallel
                 else f'calls: {marker} "[" call "]"']
        free = r"TEXT: /(?s:.+)/ & ~/(?s:.*\[TOOL_CALLS\].*)/"
    start = "start: TEXT | calls" if tools.choice == "auto" else "start: calls"
    return "\n".join([start, *rules, free] if tools.choice == "auto" else [start, *rules]) + "\n"


def _arguments(call: dict[str, Any]) -> Any:
    """A call's arguments as the templates want them: an object (OpenAI sends them as JSON text)."""
    arguments = call.get("function", {}).get("arguments", {})
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def template_inputs(messages: list[dict[str, Any]], tools: ToolCalling | None,
                    renders_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: as OpenAI sent them where the template renders tools
    (call arguments as objects), else with ponder's tool block in the system message and earlier calls
    and results written as Hermes blocks."""
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if calls:
            if renders_tools:
                message["tool_calls"] = [{**c, "function": {**c.get("function", {}), "arguments": _arguments(c)}}
                                         for c in calls]
            else:
                blocks = [f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': _arguments(c)})}"
                          f"\n</tool_call>" for c in calls]
                message["content"] = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
                del message["tool_calls"]
        if message.get("role") == "tool" and not renders_tools:
            message = {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
        if message.get("content") is None:
            message["content"] = ""
        out.append(message)
    if tools is None:
        return out, None
    if renders_tools:
        return out, list(tools.tools)
    block = TOOL_BLOCK.format(tools="\n".join(json.dumps(t) for t in tools.tools))
    if out and out[0].get("role") in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, None
