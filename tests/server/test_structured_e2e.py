"""Structured outputs and tool calls end to end: `ponder serve` on the embedded model (SmolLM2-135M,
Q4_1 GGUF), driven by the OpenAI SDK (its `parse`, streams and tool calls) and raw HTTP. Every output
a schema asks for validates with jsonschema, streaming and not, plain and in search."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.server.live import live_server

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                                                    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                   "required": ["name", "age"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False},
    "array_of_enums": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}},
        "required": ["colors"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}, {"type": "null"}]}},
        "required": ["value"], "additionalProperties": False},
    "formats_and_lengths": {"type": "object", "properties": {
        "day": {"type": "string", "format": "date"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
        "note": {"type": "string", "minLength": 2, "maxLength": 10}},
        "required": ["day", "code", "note"], "additionalProperties": False},
}
SEARCH = {"strategy": "beam", "n": 4, "beam_width": 2, "max_step_tokens": 24, "verifier": "confidence"}


@pytest.fixture(scope="module")
def server():
    with live_server("--device", "cpu", env={"PONDER_CACHE__NUM_BLOCKS": "1024"}) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def validate(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_the_sdk_s_parse_returns_a_parsed_object(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Make up a person."}], response_format=Person,
        max_tokens=60, temperature=0)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and person.name
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("search", [False, True])
def test_every_output_validates(client, name, stream, search):
    schema = SCHEMAS[name]
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": f"Give an example of {name}."}],
                  response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                          "strict": True}},
                  max_tokens=160, temperature=0.8, seed=11, n=2)
    if search:
        kwargs["extra_body"] = {"search": SEARCH}
    if stream:
        texts: dict[int, str] = {}
        reasons: dict[int, str] = {}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
                reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    else:
        completion = client.chat.completions.create(**kwargs)
        texts = {c.index: c.message.content for c in completion.choices}
        reasons = {c.index: c.finish_reason for c in completion.choices}
    assert sorted(texts) == [0, 1]
    for index, text in texts.items():
        assert reasons[index] == "stop", (text, reasons)
        validate(text, schema)


def test_vllm_s_structured_outputs_and_the_older_guided_names(client):
    for extra in ({"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]}):
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is ice cold?"}],
                                                max_tokens=5, temperature=0, extra_body=extra)
        assert answer.choices[0].message.content in ("yes", "no")
    for extra in ({"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}, {"guided_regex": "[0-9]{3}-[0-9]{4}"}):
        answer = client.completions.create(model=MODEL, prompt="A phone number:", max_tokens=12, temperature=0,
                                           extra_body=extra)
        assert len(answer.choices[0].text) == 8 and answer.choices[0].text[3] == "-"
    answer = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0,
                                            extra_body={"structured_outputs": {"grammar": 'root ::= "sunny" | "rainy"'}})
    assert answer.choices[0].message.content in ("sunny", "rainy")
    answer = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0,
                                            response_format={"type": "json_object"})
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def check_call(call, tool: dict) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_tool_calls_validate(client, choice):
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                            max_tokens=80, temperature=0)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls
    for call in message.tool_calls:
        check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
    if isinstance(choice, dict):
        assert [c.function.name for c in message.tool_calls] == ["get_time"]


def test_a_streamed_tool_call_arrives_as_openai_s_deltas(client):
    calls: dict[int, dict] = {}
    reason = None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=80, temperature=0, stream=True):
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": part.id, "name": "", "arguments": ""})
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_auto_answers_in_text_or_with_a_valid_call(client):
    for seed in range(4):
        answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="auto",
                                                max_tokens=60, temperature=1.0, seed=seed)
        message = answer.choices[0].message
        if message.tool_calls:
            assert answer.choices[0].finish_reason == "tool_calls"
            check_call(message.tool_calls[0], WEATHER)
        else:
            assert message.content and "<tool_call>" not in message.content


def test_the_deprecated_functions_answer_with_function_call(server):
    body = {"model": MODEL, "messages": ASK, "functions": [WEATHER["function"]],
            "function_call": {"name": "get_weather"}, "max_tokens": 60, "temperature": 0}
    answer = httpx.post(server + "/v1/chat/completions", json=body, timeout=60).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "function_call"
    assert choice["message"]["function_call"]["name"] == "get_weather"
    jsonschema.validate(json.loads(choice["message"]["function_call"]["arguments"]), WEATHER["function"]["parameters"])


def test_a_tool_round_trip_renders_calls_and_results(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=80, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                            max_tokens=40, temperature=0)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    tokens = httpx.post(str(client.base_url).removesuffix("v1/") + "tokenize",
                        json={"messages": history}, timeout=30).json()["count"]
    assert tokens > 40  # the call and the tool's result are in the prompt


def test_search_picks_a_tool_call_among_its_candidates(client):
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                            max_tokens=80, temperature=0.8, seed=5,
                                            extra_body={"search": {**SEARCH, "select": "majority"}})
    assert answer.choices[0].finish_reason == "tool_calls"
    check_call(answer.choices[0].message.tool_calls[0], WEATHER)
    assert answer.choices[0].model_extra["search"]["answer"].startswith('[["get_weather"')
