"""Thinking told from the answer (runtime.wire.reasoning), and chat_template_kwargs reaching the published
templates of the models that think (tests/data/templates, copied from llama.cpp's models/templates)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.requests.state import prompt_token_ids, tokenize
from runtime.wire.protocol import GenerateRequest, TokenizeRequest
from runtime.wire.reasoning import ReasoningStream, opens_thinking, reasoning_format_of, split_reasoning

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"
ASK = ({"role": "user", "content": "2+2?"},)


@pytest.mark.parametrize("text, starts_open, expected", [
    ("<think>\nadd them\n</think>\n\n4", False, ("\nadd them\n", "4")),  # Qwen3, SmolLM3: the model opens
    ("add them\n</think>\n\n4", True, ("add them\n", "4")),  # Qwen3.5, R1: the prompt opened it
    ("4", False, (None, "4")),  # thinking off: the prompt closed the block
    ("  4 <think>x</think>", False, (None, "  4 <think>x</think>")),  # not at the start: the answer's
    ("still thinking", True, ("still thinking", "")),  # cut short by max_tokens
    ("<think>still", False, ("still", "")),
    ("a</think>4</think>5", True, ("a", "4</think>5")),  # one block: a later tag is the answer's
    ("\n\n<think>a</think>b", False, ("a", "b")),
    ("", True, ("", "")),
])
def test_split_reasoning(text, starts_open, expected):
    assert split_reasoning(text, "think", starts_open) == expected


def test_no_format_leaves_the_text_whole():
    assert split_reasoning("<think>a</think>b", "none", False) == (None, "<think>a</think>b")


@pytest.mark.parametrize("text, starts_open", [
    ("<think>\nadd them\n</think>\n\n4", False), ("add them\n</think>\n\n4 and </think> and <", True),
    ("4 <", False), ("<thi", False), ("  \n", False), ("x</thi", True), ("<think>a</think>  ", False)])
def test_a_stream_cut_anywhere_gives_the_same_split(text, starts_open):
    whole = split_reasoning(text, "think", starts_open)
    for cuts in ([1] * len(text), [3] * len(text), [len(text)]):
        stream, thinking, answer, at = ReasoningStream("think", starts_open), "", "", 0
        for size in cuts:
            t, a = stream.feed(text[at:at + size])
            thinking, answer, at = thinking + t, answer + a, at + size
        t, a = stream.finish()
        assert (thinking + t if stream.has_thought else None, answer + a) == whole, cuts


def test_a_tag_arriving_in_pieces_is_held_back_not_sent():
    stream = ReasoningStream("think", True)
    assert stream.feed("ab</th") == ("ab", "")
    assert stream.feed("ink>\n\n") == ("", "")
    assert stream.feed("4") == ("", "4")


def tokenizer_with(template_file: str, tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.replicas import tokenizers as tk
    from tests.replicas.generators import qwen_tokenizer

    directory = tmp_path_factory.mktemp(template_file.split(".")[0])
    template = (TEMPLATES / template_file).read_text()
    tk.write_tokenizer(qwen_tokenizer(tk.QWEN3_SPECIALS + ("<｜Assistant｜>", "<｜User｜>"), template), directory)
    return AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    names = ["Qwen3.5-4B.jinja", "Qwen-Qwen3-0.6B.jinja", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
             "HuggingFaceTB-SmolLM3-3B.jinja"]
    return {name.split(".jinja")[0]: tokenizer_with(name, tmp_path_factory) for name in names}


def rendered(tokenizer, **kwargs) -> str:
    ids = prompt_token_ids(GenerateRequest(request_id="r", endpoint="chat", messages=ASK, **kwargs), tokenizer)
    return tokenizer.decode(ids)


# The generation prompt's end, thinking left to the template / on / off, and whether it opens thinking.
PROMPT_ENDS = {
    "Qwen3.5-4B": ("assistant\n<think>\n", "assistant\n<think>\n", "assistant\n<think>\n\n</think>\n\n"),
    "Qwen-Qwen3-0.6B": ("assistant\n", "assistant\n", "assistant\n<think>\n\n</think>\n\n"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("<｜Assistant｜><think>\n</think>", "<｜Assistant｜><think>\n",
                                                 "<｜Assistant｜><think>\n</think>"),
    "HuggingFaceTB-SmolLM3-3B": ("assistant\n", "assistant\n", "assistant\n<think>\n\n</think>\n"),
}
OPENS = {"Qwen3.5-4B": (True, True, False), "Qwen-Qwen3-0.6B": (False, False, False),
         "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": (False, True, False),
         "HuggingFaceTB-SmolLM3-3B": (False, False, False)}


@pytest.mark.parametrize("name", sorted(PROMPT_ENDS))
def test_enable_thinking_reaches_each_published_template(tokenizers, name):
    tokenizer = tokenizers[name]
    assert reasoning_format_of(tokenizer.chat_template) == "think"
    prompts = [rendered(tokenizer), rendered(tokenizer, chat_template_kwargs={"enable_thinking": True}),
               rendered(tokenizer, chat_template_kwargs={"enable_thinking": False})]
    assert tuple(p[-len(end):] == end for p, end in zip(prompts, PROMPT_ENDS[name])) == (True, True, True), prompts
    assert tuple(opens_thinking(p, "think") for p in prompts) == OPENS[name]


def test_tokenize_renders_with_the_kwargs_too(tokenizers):
    tokenizer = tokenizers["Qwen3.5-4B"]
    answer = tokenize(TokenizeRequest(request_id="t", messages=ASK, chat_template_kwargs={"enable_thinking": False}),
                      tokenizer, 4096)
    assert tokenizer.decode(list(answer.token_ids)).endswith("<think>\n\n</think>\n\n")


def test_an_earlier_answers_thinking_goes_back_as_the_template_wants(tokenizers):
    turns = ({"role": "user", "content": "1+1?"},
             {"role": "assistant", "content": "2", "reasoning_content": "one and one"},
             {"role": "user", "content": "2+2?"})
    # Qwen3 drops the thinking of a turn before the last question.
    qwen3 = tokenizers["Qwen-Qwen3-0.6B"]
    text = qwen3.decode(prompt_token_ids(GenerateRequest(request_id="r", endpoint="chat", messages=turns), qwen3))
    assert "one and one" not in text and "<|im_start|>assistant\n2<|im_end|>" in text
    # ... and keeps that of the answer being continued after a tool's result.
    tool_turns = turns[:2] + ({"role": "assistant", "content": "", "reasoning_content": "call it",
                               "tool_calls": [{"id": "c", "type": "function",
                                               "function": {"name": "add", "arguments": "{}"}}]},
                              {"role": "tool", "content": "4", "tool_call_id": "c"})
    kept = qwen3.decode(prompt_token_ids(
        GenerateRequest(request_id="r", endpoint="chat", messages=turns[:1] + tool_turns[2:]), qwen3))
    assert "<think>\ncall it\n</think>" in kept


def test_a_template_without_the_closing_tag_has_no_format():
    assert reasoning_format_of("{{ messages }}") == "none" and reasoning_format_of(None) == "none"
    assert not opens_thinking("<think>\n", "none")
