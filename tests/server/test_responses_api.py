"""OpenAI's Responses API without a server: input items become the chat request the chat route runs, and
chat answers and stream chunks become the response and its events, exactly."""

from __future__ import annotations

import json

import pytest

from server.errors import APIError
from server.responses_api.output import ResponseStream, response_body
from server.responses_api.schemas import ResponsesRequest

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather now in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def test_items_become_the_chat_messages_of_a_tool_round_trip():
    items = [{"role": "user", "content": "Weather?"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "18C"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "20C"}]},
             {"role": "developer", "content": [{"type": "input_text", "text": "And "}, {"type": "input_text",
                                                                                       "text": "tomorrow?"}]}]
    chat = request(instructions="Be brief.", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                   parallel_tool_calls=False, max_output_tokens=9, temperature=0.5).to_chat(items)
    call = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    assert chat.wire_messages() == (
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": call},
        {"role": "tool", "content": "18C", "tool_call_id": "c1"}, {"role": "tool", "content": "20C", "tool_call_id": "c2"},
        {"role": "developer", "content": "And tomorrow?"})
    tools = chat.tool_calling()
    assert (tools.choice, tools.name, tools.parallel) == ("function", "get_weather", False)
    assert (chat.max_tokens, chat.temperature, chat.stream) == (9, 0.5, False)
    fmt = request(text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}).to_chat(HI)
    assert fmt.constraint().kind == "json_schema" and json.loads(fmt.constraint().spec) == {"type": "object"}


HI = [{"role": "user", "content": "hi"}]


def test_a_tool_call_without_a_message_before_it_is_an_assistant_message_of_its_own():
    chat = request().to_chat([{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}])
    assert chat.wire_messages() == ({"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},)


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search_preview"}]}, "tools.0.type"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools.0.defer_loading"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs", "file_search_call.results"]}, "include.1"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"tools": [WEATHER], "text": {"format": {"type": "json_object"}}}, "text.format"),
])
def test_what_cannot_be_obeyed_is_a_400_naming_it(fields, param):
    with pytest.raises(APIError) as caught:
        request(**fields).to_chat(HI)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_included_logprobs_ask_the_chat_path_for_them():
    chat = request(include=["message.output_text.logprobs"], top_logprobs=3).to_chat(HI)
    assert (chat.logprobs, chat.top_logprobs) == (True, 3)
    assert not request(top_logprobs=3).to_chat(HI).logprobs  # as OpenAI: only when included
    entry = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}
    body = response_body({"id": "resp_1"}, {**CHAT, "choices": [{"index": 0, "finish_reason": "stop", "logprobs": {
        "content": [entry]}, "message": {"role": "assistant", "content": "a"}}]})
    assert body["output"][0]["content"][0]["logprobs"] == [entry]
    stream = ResponseStream({"id": "resp_1"})
    events = [e for raw in [sse({"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": "a"},
                                                                       "logprobs": {"content": [entry]},
                                                                       "finish_reason": "stop"}]}),
                            b"data: [DONE]\n\n"] for e in stream.feed(raw)]
    delta = json.loads(events[2].decode().split("\n")[1].removeprefix("data: "))
    assert delta["type"] == "response.output_text.delta" and delta["logprobs"] == [entry]
    assert stream.final["output"][0]["content"][0]["logprobs"] == [entry]


def test_background_false_and_an_empty_include_are_accepted():
    assert request(background=False, include=[], reasoning={}).to_chat(HI).wire_messages() == ({"role": "user",
                                                                                                "content": "hi"},)


CHAT = {"id": "chatcmpl-abc", "model": "m", "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                                      "prompt_tokens_details": {"cached_tokens": 4}}}
USAGE = {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 3,
         "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 10}


def test_a_chat_answer_becomes_the_response():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    body = response_body({"id": "resp_1", "model": "m"}, {**CHAT, "choices": [{
        "index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": "Sure.",
                                                               "tool_calls": [call]}}]})
    message, function = body["output"]
    assert message["type"] == "message" and message["content"] == [
        {"type": "output_text", "text": "Sure.", "annotations": [], "logprobs": []}]
    assert {k: function[k] for k in ("type", "call_id", "name", "arguments", "status")} == {
        "type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
        "status": "completed"}
    assert (body["status"], body["incomplete_details"], body["usage"]) == ("completed", None, USAGE)
    cut = response_body({"id": "resp_1"}, {**CHAT, "choices": [{"index": 0, "finish_reason": "length",
                                                                 "message": {"role": "assistant", "content": "a"}}]})
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})


def sse(payload) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def chunk(delta: dict, finish: str | None = None) -> bytes:
    return sse({"id": "chatcmpl-abc", "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                "usage": {"prompt_tokens": 7, "completion_tokens": 3}})


def test_chat_chunks_become_the_responses_events_in_order():
    stream = ResponseStream({"id": "resp_1", "model": "m"})
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    raws = [b": search started\n\n", chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}),
            chunk({"content": "lo"}), chunk({"tool_calls": [call]}, "tool_calls"), b"data: [DONE]\n\n"]
    out = [e for e in stream.start()] + [e for raw in raws for e in stream.feed(raw)]
    assert out[2] == b": search started\n\n"
    events = [json.loads(e.decode().split("\n")[1].removeprefix("data: ")) for e in out if not e.startswith(b":")]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(14))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[2]["item"]["content"] == [] and events[6]["text"] == "Hello"
    assert (events[9]["output_index"], events[9]["item"]["arguments"], events[10]["delta"]) == (1, "", '{"a": 1}')
    final = events[-1]["response"]
    assert final == stream.final and final["status"] == "completed" and final["usage"]["output_tokens"] == 3
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["output"][0]["status"] == "completed"


def test_an_error_in_the_stream_fails_the_response_and_nothing_is_final():
    stream = ResponseStream({"id": "resp_1"})
    stream.start()
    out = stream.feed(sse({"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}))
    assert stream.feed(b"data: [DONE]\n\n") == [] and stream.final is None
    event = json.loads(out[0].decode().split("\n")[1].removeprefix("data: "))
    assert event["type"] == "response.failed" and event["response"]["error"] == {"code": "server_error",
                                                                                  "message": "boom"}


def test_reasoning_items_go_with_the_assistant_message_after_them():
    from server.responses_api.schemas import chat_messages

    assert chat_messages([{"role": "user", "content": "q"},
                          {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}]},
                          {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}], "input")[1] == {
        "role": "assistant", "content": None, "reasoning_content": "think",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_a_reasoning_model_s_thinking_is_a_reasoning_item_before_the_message():
    stream = ResponseStream({"id": "resp_1"})
    raws = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "Let me "}),
            chunk({"reasoning_content": "see."}), chunk({"content": "Blue."}, "stop"), b"data: [DONE]\n\n"]
    out = stream.start() + [e for raw in raws for e in stream.feed(raw)]
    events = [json.loads(e.decode().split("\n")[1].removeprefix("data: ")) for e in out]
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    reasoning, message = stream.final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me see."}] and reasoning["summary"] == []
    assert message["content"][0]["text"] == "Blue." and events[7]["output_index"] == 1
    whole = response_body({"id": "resp_1"}, {**CHAT, "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "Blue.", "reasoning_content": "Let me see."}}]})
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"] == reasoning["content"]
