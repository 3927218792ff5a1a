"""Anthropic's Messages API end to end: `ponder serve` on the embedded model (SmolLM2-135M) with an API
key, driven by the `anthropic` SDK (create, stream, count_tokens, a tool round trip), langchain-anthropic's
`ChatAnthropic.bind_tools` and raw HTTP, each answer held to what the chat route answers for the same
conversation."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.server.live import live_server, metric

anthropic = pytest.importorskip("anthropic")

MODEL = "SmolLM2-135M-Instruct"
KEY = "test-key"
WEATHER = {"name": "get_weather", "description": "The weather now in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # the SDK has no temperature argument any more: sent as extra_body
SEARCH = {"strategy": "beam", "n": 4, "beam_width": 2, "max_step_tokens": 24, "verifier": "confidence"}


@pytest.fixture(scope="module")
def server():
    with live_server("--device", "cpu", "--api-key", KEY, env={"PONDER_CACHE__NUM_BLOCKS": "1024"}) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


def chat(server: str, **fields) -> dict:
    r = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, **fields},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_create_answers_what_the_chat_route_answers(server, client):
    message = client.messages.create(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Name a color."}],
                                     system="Answer in one sentence.", extra_body=GREEDY)
    expected = chat(server, messages=[{"role": "system", "content": "Answer in one sentence."},
                                      {"role": "user", "content": "Name a color."}], max_tokens=12, temperature=0)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected["choices"][0]["message"]["content"]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[expected["choices"][0]["finish_reason"]]
    assert message.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == expected["usage"]["completion_tokens"]


def test_a_stream_sends_anthropic_s_events_and_the_same_text(client):
    kwargs = dict(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Name a color."}], extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta", "text"}  # "text": the SDK's own event beside each delta
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)


def test_a_stop_sequence_met_is_cut_off_and_named(client):
    kwargs = dict(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Name a color."}], extra_body=GREEDY)
    text = client.messages.create(**kwargs).content[0].text
    stop = text.split()[2]  # a word the greedy answer writes
    cut = text[:text.index(stop)]
    message = client.messages.create(stop_sequences=[stop, "\u00a7never"], **kwargs)
    assert (message.content[0].text, message.stop_reason, message.stop_sequence) == (cut, "stop_sequence", stop)
    with client.messages.stream(stop_sequences=[stop], **kwargs) as stream:
        final = stream.get_final_message()
    assert (final.content[0].text, final.stop_reason, final.stop_sequence) == (cut, "stop_sequence", stop)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(server, client, stream):
    kwargs = dict(model=MODEL, max_tokens=80, messages=ASK, tools=[WEATHER], extra_body=GREEDY,
                  tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    if stream:
        with client.messages.stream(**kwargs) as events:
            first = events.get_final_message()
    else:
        first = client.messages.create(**kwargs)
    assert first.stop_reason == "tool_use"
    [call] = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    history = ASK + [{"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": "18 degrees and sunny"}]}]
    second = client.messages.create(model=MODEL, max_tokens=20, messages=history, tools=[WEATHER],
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert second.content[0].type == "text" and second.content[0].text
    assert second.stop_reason in ("end_turn", "max_tokens")
    # the same conversation on the chat route (the call and its result rendered): the same prompt
    texts = [b.text for b in first.content if b.type == "text"]
    expected = chat(server, max_tokens=1, temperature=0, tools=[{"type": "function", "function": {
        "name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}],
        tool_choice="none", messages=ASK + [
            {"role": "assistant", "content": "".join(texts) or None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}])
    assert second.usage.input_tokens == expected["usage"]["prompt_tokens"]


def test_count_tokens_equals_the_prompt_tokens_a_chat_request_reports(server, client):
    system = "You are terse."
    for tools in (None, [WEATHER]):
        extra = {"tools": tools} if tools else {}
        counted = client.messages.count_tokens(model=MODEL, system=system, messages=ASK, **extra)
        chat_tools = {"tools": [{"type": "function", "function": {
            "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}} for t in tools]} \
            if tools else {}
        expected = chat(server, messages=[{"role": "system", "content": system}, *ASK], max_tokens=1, **chat_tools)
        assert counted.input_tokens == expected["usage"]["prompt_tokens"]
    assert client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER]).input_tokens > \
        client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens


def test_output_config_format_is_the_chat_path_s_json_schema(client):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    message = client.messages.create(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "A color?"}],
                                     output_config={"format": {"type": "json_schema", "schema": schema}},
                                     extra_body=GREEDY)
    jsonschema.validate(json.loads(message.content[0].text), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_search_answers_with_its_summary(client, stream):
    kwargs = dict(model=MODEL, max_tokens=48, messages=[{"role": "user", "content": "What is 2 + 3?"}],
                  extra_body={"search": SEARCH})
    if stream:
        raw = client.messages.create(stream=True, **kwargs)
        events = list(raw)
        search = events[-2].model_extra["search"]
        assert events[-2].type == "message_delta"
    else:
        message = client.messages.create(**kwargs)
        search = message.model_extra["search"]
    assert search["strategy"] == "beam" and search["paths_explored"] >= 4 and "score" in search


def test_the_key_goes_as_x_api_key_or_bearer_and_errors_are_anthropic_s(server, client):
    body = {"model": MODEL, "max_tokens": 2, "messages": ASK}
    missing = httpx.post(server + "/v1/messages", json=body)
    assert missing.status_code == 401
    assert missing.json() == {"type": "error", "error": {"type": "authentication_error", "message": missing.json()[
        "error"]["message"]}} and "x-api-key" in missing.json()["error"]["message"]
    assert httpx.post(server + "/v1/messages", json=body, headers={"x-api-key": "wrong"}).status_code == 401
    assert httpx.post(server + "/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60).status_code == 200
    headers = {"x-api-key": KEY}
    no_max = httpx.post(server + "/v1/messages", json={"model": MODEL, "messages": ASK}, headers=headers)
    assert no_max.status_code == 400
    assert no_max.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                        "message": "max_tokens: Field required"}}
    unknown = httpx.post(server + "/v1/messages", json={**body, "mcp_servers": []}, headers=headers)
    assert unknown.status_code == 400 and unknown.json()["error"]["message"].startswith("mcp_servers: ")
    image = httpx.post(server + "/v1/messages", headers=headers, json={**body, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]})
    assert image.status_code == 400 and image.json()["error"]["message"] == (
        "messages.0.content: block 0 has type 'image': this server takes text, tool_use, tool_result, thinking, "
        "redacted_thinking blocks")
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="some-other-model", max_tokens=2, messages=ASK)
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=2, messages=ASK,
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert caught.value.body["error"]["message"].startswith("tools.0.type: ")


def test_metrics_count_the_route_like_the_chat_route(server, client):
    headers = {"Authorization": f"Bearer {KEY}"}
    before = metric(server, "ponder_requests_total", headers, 0.0, endpoint="messages", status="200")
    edge = metric(server, "ponder_http_requests_total", headers, 0.0, route="/v1/messages", method="POST", status="200")
    client.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    with client.messages.stream(model=MODEL, max_tokens=2, messages=ASK) as stream:
        stream.get_final_message()
    assert metric(server, "ponder_requests_total", headers, endpoint="messages", status="200") == before + 2
    assert metric(server, "ponder_http_requests_total", headers, route="/v1/messages", method="POST",
                  status="200") == edge + 2


def test_langchain_anthropic_binds_a_tool_and_reads_its_result(server):
    chat_models = pytest.importorskip("langchain_anthropic")
    from langchain_core.messages import HumanMessage, ToolMessage

    def get_weather(city: str) -> str:
        """The weather now in a city."""
        return f"18 degrees and sunny in {city}"

    model = chat_models.ChatAnthropic(model=MODEL, base_url=server, api_key=KEY, max_tokens=80, temperature=0,
                                      max_retries=0)
    asked = [HumanMessage(ASK[0]["content"])]
    called = model.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False).invoke(asked)
    [call] = called.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    answer = model.invoke(asked + [called, ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])])
    assert answer.text and not answer.tool_calls
    streamed = "".join(chunk.text for chunk in model.stream(asked))
    assert streamed == model.invoke(asked).text
