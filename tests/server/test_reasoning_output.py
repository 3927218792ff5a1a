"""A thinking model's chat answer as vLLM returns it (server.reasoning_output): the thinking in
`reasoning_content` and `reasoning`, the answer alone in `content`, tool calls parsed from the answer only,
and in a stream the thinking deltas ahead of the content deltas."""

from __future__ import annotations

import json

from runtime.wire.protocol import Delta
from server.reasoning_output import Thinking, chat_message
from server.responses import ChunkWriter
from server.tool_output import ToolCalls

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'


def thinking(opens: list[bool], n: int = 1, include: bool = True) -> Thinking:
    out = Thinking("think", include)
    out.start(opens, n)
    return out


def test_the_message_carries_the_thinking_apart_from_the_answer():
    message, reason = chat_message(0, "add them\n</think>\n\n4", "stop", thinking([True]), None)
    assert (message, reason) == ({"role": "assistant", "content": "4", "reasoning_content": "add them\n",
                                  "reasoning": "add them\n"}, "stop")


def test_each_prompt_starts_open_or_not_as_its_prompt_left_it():
    shared = thinking([False, True], n=2)  # choices 0, 1 from the first prompt; 2, 3 from the second
    assert [chat_message(i, "a</think>b", None, shared, None)[0]["reasoning"] for i in range(4)] == \
        [None, None, "a", "a"]


def test_all_thinking_is_a_null_content_and_no_thinking_a_null_reasoning():
    assert chat_message(0, "still", "length", thinking([True]), None)[0] == {
        "role": "assistant", "content": None, "reasoning_content": "still", "reasoning": "still"}
    assert chat_message(0, "4", "stop", thinking([False]), None)[0] == {
        "role": "assistant", "content": "4", "reasoning_content": None, "reasoning": None}


def test_include_reasoning_false_leaves_the_thinking_out():
    assert chat_message(0, "a</think>4", "stop", thinking([True], include=False), None)[0] == {
        "role": "assistant", "content": "4"}


def test_tool_calls_are_parsed_from_the_answer_only():
    tools = ToolCalls("hermes")
    message, reason = chat_message(0, f"maybe {CALL}?\n</think>\n\n{CALL}", "stop", thinking([True]), tools)
    assert reason == "tool_calls" and message["content"] is None
    assert message["reasoning_content"] == f"maybe {CALL}?\n"
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "add", "arguments": '{"a": 2}'}]
    thought_only, reason = chat_message(0, f"{CALL}\n</think>\n\nno call", "stop", thinking([True]), ToolCalls("hermes"))
    assert reason == "stop" and "tool_calls" not in thought_only and thought_only["content"] == "no call"


def stream(pieces: list[str], opens: bool, tools: ToolCalls | None = None) -> list[dict]:
    writer = ChunkWriter("id", 0, "m", True, False)
    shared = thinking([opens])
    deltas = []
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        chunk = writer.delta_chunk(Delta(request_id="r", index=0, text=piece, token_ids=(1,),
                                         finish_reason="stop" if last else None), 0, tools, shared)
        deltas.append(json.loads(chunk.decode().removeprefix("data: "))["choices"][0])
    return deltas


def test_a_stream_sends_thinking_deltas_then_content_deltas():
    deltas = [c["delta"] for c in stream(["add ", "them\n</th", "ink>\n\n", "4", ""], True)]
    assert deltas == [{"reasoning_content": "add ", "reasoning": "add "},
                      {"reasoning_content": "them\n", "reasoning": "them\n"}, {}, {"content": "4"}, {}]


def test_a_delta_that_crosses_the_tag_carries_both_thinking_first():
    [choice] = stream(["a</think>b"], True)
    assert list(choice["delta"].items()) == [("reasoning_content", "a"), ("reasoning", "a"), ("content", "b")]


def test_a_streamed_tool_call_comes_from_the_answer_only():
    choices = stream([f"{CALL}\n</think>\n\n", CALL, ""], True, ToolCalls("hermes"))
    assert choices[0]["delta"]["reasoning_content"] == f"{CALL}\n" and "tool_calls" not in choices[0]["delta"]
    assert choices[1]["delta"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2}'}
    assert choices[-1]["finish_reason"] == "tool_calls"
