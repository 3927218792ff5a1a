"""Anthropic's Messages API without a server: the request becomes the chat request the chat route runs,
and chat answers and stream chunks become Anthropic's message and events, exactly."""

from __future__ import annotations

import json

import pytest

from server.errors import APIError
from server.messages_api.output import MessageStream, message_body
from server.messages_api.schemas import CountTokensRequest, MessagesRequest

WEATHER = {"name": "get_weather", "description": "The weather now in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8,
                                           "messages": [{"role": "user", "content": "hi"}], **fields})


def test_a_tool_round_trip_becomes_the_chat_messages_of_one():
    chat = request(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "call it", "signature": "s"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
            {"type": "text", "text": "And tomorrow?"}]}],
        tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        stop_sequences=["END"], temperature=0.5, top_k=5, metadata={"user_id": "u1"}).to_chat()
    assert chat.wire_messages() == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
         "reasoning_content": "call it"},  # an earlier turn's thinking goes back to the template
        {"role": "tool", "content": "18C", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And tomorrow?"})
    tools = chat.tool_calling()
    assert (tools.choice, tools.name, tools.parallel) == ("function", "get_weather", False)
    assert tools.tools[0]["function"] == {"name": "get_weather", "description": "The weather now in a city",
                                          "parameters": WEATHER["input_schema"]}
    assert (chat.max_tokens, chat.temperature, chat.top_k, chat.stop, chat.include_stop_str_in_output, chat.user) == \
        (8, 0.5, 5, ["END"], True, "u1")
    assert not chat.stream and "top_p" not in chat.model_fields_set  # unset: the model's default applies


def test_an_earlier_turn_s_thinking_goes_to_the_chat_path_as_reasoning_content():
    assistant = request(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": "s"}, {"type": "text", "text": "A."}]},
        {"role": "user", "content": "q2"}]).chat_fields()["messages"][1]
    assert assistant == {"role": "assistant", "content": [{"type": "text", "text": "A."}], "reasoning_content": "hmm"}


@pytest.mark.parametrize("choice, expected", [({"type": "auto"}, "auto"), ({"type": "any"}, "required")])
def test_tool_choice_auto_and_any(choice, expected):
    assert request(tools=[WEATHER], tool_choice=choice).to_chat().tool_calling().choice == expected
    assert request(tools=[WEATHER], tool_choice={"type": "none"}).to_chat().tool_calling() is None


def test_a_stream_asks_the_chat_path_for_continuous_usage():
    chat = request(stream=True, output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}}).to_chat()
    assert chat.stream and chat.stream_options.include_usage and chat.stream_options.continuous_usage_stats
    assert chat.constraint().kind == "json_schema" and json.loads(chat.constraint().spec) == {"type": "object"}


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]}, "tools.0.type"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools.0.defer_loading"),
    ({"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, "tools.0.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.type"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"container": "c1"}, "container"),
    ({"tools": [WEATHER], "output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config.format"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]}, "messages.1.role"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]},
     "messages.0.content.0.type"),
])
def test_what_cannot_be_obeyed_is_a_400_naming_it(fields, param):
    with pytest.raises(APIError) as caught:
        request(**fields).to_chat()
    assert (caught.value.status, caught.value.param) == (400, param)
    body = caught.value.anthropic_body()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(param + ": ")


def test_count_tokens_takes_no_max_tokens():
    chat = CountTokensRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                              "tools": [WEATHER]}).to_chat()
    assert chat.wire_messages() == ({"role": "user", "content": "hi"},) and chat.tool_calling().choice == "auto"


CHAT = {"id": "chatcmpl-abc", "model": "m", "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                                      "prompt_tokens_details": {"cached_tokens": 4}}}


def test_a_chat_answer_becomes_a_message():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    body = message_body({**CHAT, "choices": [{"index": 0, "finish_reason": "tool_calls",
                                              "message": {"role": "assistant", "content": None, "tool_calls": [call]}}]}, [])
    assert body == {"id": "msg_abc", "type": "message", "role": "assistant", "model": "m",
                    "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}],
                    "stop_reason": "tool_use", "stop_sequence": None,
                    "usage": {"input_tokens": 7, "output_tokens": 3, "cache_read_input_tokens": 4,
                              "cache_creation_input_tokens": 0}}
    stopped = message_body({**CHAT, "choices": [{"index": 0, "finish_reason": "stop",
                                                 "message": {"role": "assistant", "content": "one, two END"}}],
                            "search": {"strategy": "beam"}}, ["STOP", "END"])
    assert stopped["content"] == [{"type": "text", "text": "one, two "}]
    assert (stopped["stop_reason"], stopped["stop_sequence"], stopped["search"]) == ("stop_sequence", "END",
                                                                                     {"strategy": "beam"})
    cut = message_body({**CHAT, "choices": [{"index": 0, "finish_reason": "length",
                                             "message": {"role": "assistant", "content": ""}}]}, [])
    assert (cut["content"], cut["stop_reason"]) == ([{"type": "text", "text": ""}], "max_tokens")


def sse(payload) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def chunk(delta: dict, finish: str | None = None, completion_tokens: int = 1, **extra) -> bytes:
    return sse({"id": "chatcmpl-abc", "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                                                 **extra}],
                "usage": {"prompt_tokens": 7, "completion_tokens": completion_tokens}})


def events(raws: list[bytes], stops: list[str]) -> list[tuple[str, dict]]:
    stream = MessageStream(stops)
    out = []
    for raw in raws:
        for event in stream.feed(raw):
            if event.startswith(b":"):
                out.append((":", {}))
                continue
            kind, data = event.decode().split("\n")[:2]
            out.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_chat_chunks_become_anthropic_s_events_in_order():
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    out = events([b": search started\n\n", chunk({"role": "assistant", "content": ""}, completion_tokens=0),
                  chunk({"reasoning_content": "hmm"}), chunk({"content": "Let me "}), chunk({"content": "check."}),
                  chunk({"tool_calls": [call]}, "tool_calls", 9, search={"score": 0.5}),
                  sse({"id": "chatcmpl-abc", "model": "m", "choices": [],
                       "usage": {"prompt_tokens": 7, "completion_tokens": 9}}),
                  sse({"id": "chatcmpl-abc", "model": "m", "choices": [], "search": {"strategy": "beam"}}),
                  b"data: [DONE]\n\n"], [])
    assert [kind for kind, _ in out] == [
        ":", "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    start = out[1][1]["message"]
    assert (start["id"], start["usage"]["input_tokens"], start["content"]) == ("msg_abc", 7, [])
    assert out[2][1] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "thinking", "thinking": "", "signature": ""}}
    assert out[3][1]["delta"] == {"type": "thinking_delta", "thinking": "hmm"}
    assert [e[1]["delta"]["text"] for e in out[6:8]] == ["Let me ", "check."] and out[6][1]["index"] == 1
    assert out[9][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    assert out[10][1] == {"type": "content_block_delta", "index": 2,
                          "delta": {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}}
    assert out[12][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                          "usage": {"output_tokens": 9}, "search": {"strategy": "beam", "score": 0.5}}


def test_a_stream_cuts_the_stop_sequence_met_and_names_it():
    out = events([chunk({"role": "assistant", "content": ""}, completion_tokens=0), chunk({"content": "a b"}),
                  chunk({"content": " cEND"}, "stop", 3), b"data: [DONE]\n\n"], ["END"])
    texts = [e[1]["delta"]["text"] for e in out if e[0] == "content_block_delta"]
    assert texts == ["a b", " c"]
    assert out[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_an_empty_answer_is_one_empty_text_block_and_an_error_ends_the_stream():
    out = events([chunk({"role": "assistant", "content": ""}, completion_tokens=0), chunk({}, "stop", 1),
                  b"data: [DONE]\n\n"], [])
    assert [kind for kind, _ in out] == ["message_start", "content_block_start", "content_block_stop",
                                         "message_delta", "message_stop"]
    assert out[1][1]["content_block"] == {"type": "text", "text": ""}
    failed = events([chunk({"role": "assistant", "content": ""}, completion_tokens=0),
                     sse({"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}),
                     b"data: [DONE]\n\n"], [])
    assert failed[-1] == ("error", {"type": "error", "error": {"type": "server_error", "message": "boom"}})
