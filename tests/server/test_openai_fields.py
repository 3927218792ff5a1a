"""Every field of OpenAI's chat-completion request is obeyed (with an effect this test observes),
refused with a 400 naming it, or accepted as metadata and documented as ignored; and malformed
`tools` / `response_format` bodies are 400s, never 500s (a fuzz over them)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.chat import completion_create_params

from server.extras import VENDOR_EXTRAS
from tests.server.live import live_server

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Name a color."}]

# Obeyed: each has a check below, or a test of its own elsewhere (named beside it).
OBEYED = {"messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed",
          "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "stream_options", "logit_bias",
          "response_format", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"}
REFUSED = {"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
           "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
           "reasoning_effort": "high", "verbosity": "low", "moderation": {"model": "omni"}}
METADATA = {"user": "u-1", "store": True, "metadata": {"k": "v"}, "service_tier": "auto",
            "prompt_cache_key": "k", "safety_identifier": "s", "prompt_cache_retention": "24h",
            "prompt_cache_options": {}}


@pytest.fixture(scope="module")
def server():
    with live_server("--device", "cpu", env={"PONDER_CACHE__NUM_BLOCKS": "512"}) as (base, _):
        yield base


def chat(server: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 6, "temperature": 0, **fields}
    return httpx.post(server + "/v1/chat/completions", json=body, timeout=120)


def content(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_every_sdk_field_is_classified():
    fields = set(completion_create_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
    unclassified = fields - OBEYED - set(REFUSED) - set(METADATA) - {"stream"}
    assert not unclassified, f"new OpenAI fields to obey or refuse: {sorted(unclassified)}"


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_what_cannot_be_obeyed_is_a_400_naming_it(server, field):
    response = chat(server, **{field: REFUSED[field]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field


def test_a_text_only_modality_is_obeyed(server):
    assert content(chat(server, modalities=["text"]))


def test_metadata_is_accepted_and_changes_nothing(server):
    plain = content(chat(server))
    assert content(chat(server, **METADATA)) == plain


def test_logit_bias_minus_100_removes_a_token_and_plus_100_forces_one(server):
    ids = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 6,
                                                            "temperature": 0, "logprobs": True}, timeout=60).json()
    first = ids["choices"][0]["logprobs"]["content"][0]["token"]
    token_id = httpx.post(server + "/tokenize", json={"prompt": first, "add_special_tokens": False}).json()["tokens"]
    assert len(token_id) == 1
    banned = chat(server, logit_bias={str(token_id[0]): -100}, logprobs=True).json()
    assert banned["choices"][0]["logprobs"]["content"][0]["token"] != first
    forced = chat(server, logit_bias={"28": 100}).json()["choices"][0]["message"]["content"]
    assert forced == httpx.post(server + "/detokenize", json={"tokens": [28] * 6}).json()["prompt"]


def test_sampling_fields_change_what_comes_back(server):
    assert len(chat(server, n=3, temperature=1.0, seed=1).json()["choices"]) == 3
    assert chat(server, max_completion_tokens=2).json()["usage"]["completion_tokens"] == 2
    seeded = [content(chat(server, temperature=1.0, seed=5, max_tokens=12)) for _ in range(2)]
    assert seeded[0] == seeded[1]
    top = chat(server, logprobs=True, top_logprobs=3).json()["choices"][0]["logprobs"]["content"][0]
    assert len(top["top_logprobs"]) == 3
    # (a list, whose tokens recur: an answer without a repeated token is the same under any penalty)
    listing = [{"role": "user", "content": "Name three colors."}]
    penalised = content(chat(server, messages=listing, frequency_penalty=2.0, presence_penalty=2.0, max_tokens=24))
    assert penalised != content(chat(server, messages=listing, max_tokens=24))
    first_word = content(chat(server, max_tokens=24)).split()[0]
    assert first_word not in content(chat(server, stop=[first_word], max_tokens=24))


def test_parallel_tool_calls_false_allows_one_call(server):
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"]}}}
    for parallel in (False, True):
        response = chat(server, tools=[tool], tool_choice="required", parallel_tool_calls=parallel, max_tokens=120,
                        temperature=1.0, seed=2)
        calls = response.json()["choices"][0]["message"]["tool_calls"]
        assert calls and (parallel or len(calls) == 1)


def test_bad_tools_and_tool_choice_are_400s_naming_the_field(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases = [
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "tools.0.function.parameters"),
        ({"tools": [tool, tool]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"tools": [tool], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "nonsense"}}}}}]}, "tools"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        ({"guided_json": "{not json"}, "response_format"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ]
    for fields, param in cases:
        response = chat(server, **fields)
        assert response.status_code == 400, (fields, response.text)
        error = response.json()["error"]
        assert error["param"] == param, (fields, error)
        assert error["type"] == "invalid_request_error" and error["message"]


json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=3), max_leaves=12)
schema_keys = st.sampled_from(["type", "properties", "items", "required", "enum", "anyOf", "pattern", "minLength",
                               "maxItems", "additionalProperties", "const", "$ref", "format"])
schemas = st.dictionaries(schema_keys, json_values | st.sampled_from(["object", "string", "integer", "array"]),
                          max_size=4)
tools = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "other"]), "function": st.one_of(
    json_values, st.fixed_dictionaries({"name": st.text(max_size=10), "parameters": schemas}))}), max_size=2)
formats = st.one_of(json_values, st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "json_object", "x"]),
                                                        "json_schema": st.one_of(json_values, st.fixed_dictionaries(
                                                            {"name": st.text(max_size=6), "schema": schemas}))}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tools=tools | json_values, choice=json_values | st.sampled_from(["auto", "required", "none"]), fmt=formats)
def test_malformed_tools_and_formats_are_never_a_500(server, tools, choice, fmt):
    for fields in ({"tools": tools, "tool_choice": choice}, {"response_format": fmt}, {"tools": tools}):
        response = chat(server, max_tokens=2, **fields)
        assert response.status_code in (200, 400), (fields, response.status_code, response.text)
        if response.status_code == 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        json.dumps(response.json())


def test_every_completions_sdk_field_is_obeyed_or_refused():
    from openai.types import completion_create_params as completion_params
    from server.schemas import CompletionRequest

    fields = set(completion_params.CompletionCreateParamsBase.__annotations__)
    assert fields - set(CompletionRequest.model_fields) == set()


def test_an_unknown_field_is_a_400_naming_it_from_plain_json_and_the_sdk(server):
    from openai import BadRequestError, OpenAI

    response = chat(server, frobnicate=True)
    assert response.status_code == 400
    assert response.json()["error"] == {"message": "unknown parameter: 'frobnicate' (no field of this name is "
                                                   "obeyed)", "type": "invalid_request_error",
                                        "param": "frobnicate", "code": "unknown_parameter"}
    client = OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                       extra_body={"messages": [{**ASK[0], "colour": "red"}]})
    assert caught.value.body["param"] == "messages.0.colour"
    completion = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                              "frobnicate": 1}, timeout=60)
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "frobnicate"


def test_an_sdk_echoed_answer_goes_back_as_a_message(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    first = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    echoed = first.choices[0].message.model_dump()  # refusal, annotations, audio, function_call: null
    again = client.chat.completions.create(model=MODEL, messages=[*ASK, echoed, {"role": "user", "content": "Why?"}],
                                           max_tokens=4, temperature=0)
    assert again.choices[0].message.content


@pytest.mark.parametrize("field", sorted(VENDOR_EXTRAS))
def test_each_documented_extra_is_obeyed_at_its_value_and_refused_by_name_at_another(server, field):
    extra = VENDOR_EXTRAS[field]
    for value in extra.obeyed:
        assert chat(server, max_tokens=1, **{field: value}).status_code == 200, (field, value)
    response = chat(server, max_tokens=1, **{field: {"not": "obeyed"}})
    if extra.switch is not None:  # a knob of a sampler that is off changes nothing; switched on, it is refused
        assert response.status_code == 200, response.text
        response = chat(server, max_tokens=1, **{field: 1, extra.switch: {"not": "obeyed"}})
        field = extra.switch
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field and response.json()["error"]["message"] == \
        f"{field}: {VENDOR_EXTRAS[field].why}"


def test_a_thinking_budget_on_a_model_that_does_not_think_is_a_400_naming_the_field(server):
    for field, value in (("thinking_token_budget", 16), ("reasoning_effort", "low")):
        response = chat(server, **{field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field
        assert "does not think in its text" in response.json()["error"]["message"]
    assert content(chat(server, reasoning_effort=None))  # null: not sent
