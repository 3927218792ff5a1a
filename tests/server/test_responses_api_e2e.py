"""OpenAI's Responses API end to end: `ponder serve` on the embedded model (SmolLM2-135M) driven by the
`openai` SDK (create, stream, parse, a function-tool round trip by input items and by
previous_response_id, retrieve, input_items, delete) and by OpenAI's Agents SDK with its default
Responses model, each answer held to what the chat route answers for the same conversation."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.server.live import live_server, metric

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather now in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
ASK = "What is the weather in Paris?"
SEARCH = {"strategy": "beam", "n": 4, "beam_width": 2, "max_step_tokens": 24, "verifier": "confidence"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("responses") / "responses.sqlite3"
    with live_server("--device", "cpu", env={"PONDER_CACHE__NUM_BLOCKS": "1024",
                                             "PONDER_RESPONSES__PATH": str(path)}) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def chat(server: str, **fields) -> dict:
    r = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, **fields}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_create_answers_what_the_chat_route_answers(server, client):
    response = client.responses.create(model=MODEL, input="Name a color.", instructions="Answer in one sentence.",
                                       max_output_tokens=12, temperature=0, metadata={"k": "v"})
    expected = chat(server, messages=[{"role": "system", "content": "Answer in one sentence."},
                                      {"role": "user", "content": "Name a color."}], max_tokens=12, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.output_text == expected["choices"][0]["message"]["content"]
    assert [item.type for item in response.output] == ["message"]
    assert response.output[0].role == "assistant" and response.output[0].status == "completed"
    finish = expected["choices"][0]["finish_reason"]
    assert response.status == {"length": "incomplete", "stop": "completed"}[finish]
    if finish == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        expected["usage"]["prompt_tokens"], expected["usage"]["completion_tokens"])
    assert (response.instructions, response.metadata, response.max_output_tokens, response.store) == (
        "Answer in one sentence.", {"k": "v"}, 12, True)


def test_a_stream_sends_the_events_the_sdk_parses_and_the_same_text(client):
    kwargs = dict(model=MODEL, input="Name a color.", max_output_tokens=24, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    final_kind = "response." + whole.status
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          final_kind]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)
    if whole.status == "completed":
        with client.responses.stream(**kwargs) as stream:
            assert stream.get_final_response().output_text == whole.output_text


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_parse_returns_a_parsed_object_through_the_chat_grammar(client):
    parsed = client.responses.parse(model=MODEL, input="Make up a person.", text_format=Person,
                                    max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, Person) and parsed.output_parsed.name
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Person"
    # (a prompt the model answers within the tokens given: cut short, the object would be incomplete)
    answer = client.responses.create(model=MODEL, input="A short JSON object about Paris.", max_output_tokens=60,
                                     temperature=0, text={"format": {"type": "json_object"}})
    assert answer.status == "completed" and isinstance(json.loads(answer.output_text), dict)


def check_call(item) -> None:
    assert item.type == "function_call" and item.name == "get_weather" and item.status == "completed"
    assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    jsonschema.validate(json.loads(item.arguments), WEATHER["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip_by_input_items_and_by_previous_response_id(server, client, stream):
    kwargs = dict(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                  temperature=0, max_output_tokens=80)
    if stream:
        with client.responses.stream(**kwargs) as events:
            first = events.get_final_response()
    else:
        first = client.responses.create(**kwargs)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and first.status == "completed"
    check_call(calls[0])
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees and sunny"}
    by_items = client.responses.create(model=MODEL, input=[{"role": "user", "content": ASK}, *first.output, result],
                                       tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=20,
                                       store=False)
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=[WEATHER],
                                      tool_choice="none", temperature=0, max_output_tokens=20)
    assert by_items.output_text and by_items.output_text == chained.output_text
    assert by_items.usage.input_tokens == chained.usage.input_tokens
    assert (by_items.store, chained.previous_response_id) == (False, first.id)
    expected = chat(server, max_tokens=20, temperature=0, tools=[CHAT_WEATHER], tool_choice="none", messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "18 degrees and sunny"}])
    assert chained.output_text == expected["choices"][0]["message"]["content"]
    assert chained.usage.input_tokens == expected["usage"]["prompt_tokens"]


def test_retrieve_input_items_and_delete(server, client):
    first = client.responses.create(model=MODEL, input="Name a color.", max_output_tokens=4, temperature=0)
    second = client.responses.create(model=MODEL, input="And another?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [(item.type, getattr(item, "role", None)) for item in items] == [
        ("message", "user"), ("message", "assistant"), ("message", "user")]
    assert items[0].content[0].text == "Name a color." and items[1].id == first.output[0].id
    assert items[2].content[0].type == "input_text" and items[2].content[0].text == "And another?"
    newest = client.responses.input_items.list(second.id, limit=1)
    assert [item.id for item in newest.data] == [items[2].id] and newest.has_more
    assert client.responses.delete(second.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=unstored.id)
    assert caught.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.0.type"),
    ({"tools": [{"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"}]},
     "tools.0.type"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["file_search_call.results"]}, "include.0"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0.arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"truncation": "auto"}, "truncation"),
    ({"unknown_field": 1}, "unknown_field"),
])
def test_what_cannot_be_obeyed_is_a_400_naming_it(server, fields, param):
    r = httpx.post(server + "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, **fields},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_included_logprobs_are_the_chat_route_s(server, client):
    kwargs = dict(model=MODEL, input="Name a color.", max_output_tokens=6, temperature=0, top_logprobs=2,
                  include=["message.output_text.logprobs"])
    whole = client.responses.create(**kwargs)
    expected = chat(server, messages=[{"role": "user", "content": "Name a color."}], max_tokens=6, temperature=0,
                    logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    part = whole.output[0].content[0]
    assert [entry.model_dump() for entry in part.logprobs] == expected and len(expected) == 6
    assert "".join(entry.token for entry in part.logprobs) == part.text and whole.top_logprobs == 2
    events = list(client.responses.create(stream=True, **kwargs))
    streamed = [e for event in events if event.type == "response.output_text.delta" for e in event.logprobs]
    assert [entry.model_dump() for entry in streamed] == expected


@pytest.mark.parametrize("stream", [False, True])
def test_search_answers_with_its_summary(client, stream):
    kwargs = dict(model=MODEL, input="What is 2 + 3?", max_output_tokens=48, extra_body={"search": SEARCH})
    if stream:
        final = list(client.responses.create(stream=True, **kwargs))[-1].response
    else:
        final = client.responses.create(**kwargs)
    search = final.model_extra["search"]
    assert search["strategy"] == "beam" and search["paths_explored"] >= 4 and "score" in search


def test_an_agent_with_the_default_responses_model_runs_a_tool_loop(server):
    agents = pytest.importorskip("agents")
    from tests.server.agent_tools import weather_agent

    cities: list[str] = []
    provider = agents.OpenAIProvider(openai_client=openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused",
                                                                      max_retries=0), use_responses=True)
    agent = weather_agent(agents, provider.get_model(MODEL), cities)
    assert type(agent.model).__name__ == "OpenAIResponsesModel"
    result = agents.Runner.run_sync(agent, ASK, max_turns=4)
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem"
    assert len(cities) == 1 and cities[0]
    assert isinstance(result.final_output, str) and result.final_output


def test_metrics_count_the_route_like_the_chat_route(server, client):
    before = metric(server, "ponder_requests_total", None, 0.0, endpoint="responses", status="200")
    client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, stream=True))
    assert metric(server, "ponder_requests_total", None, endpoint="responses", status="200") == before + 2
    missing = metric(server, "ponder_http_requests_total", None, route="/v1/responses/{response_id}", method="GET",
                     status="404", default=0.0)
    with pytest.raises(openai.NotFoundError):  # a stored response's route, counted by its template, not its id
        client.responses.retrieve("resp_none")
    assert metric(server, "ponder_http_requests_total", None, route="/v1/responses/{response_id}", method="GET",
                  status="404", default=0.0) == missing + 1
