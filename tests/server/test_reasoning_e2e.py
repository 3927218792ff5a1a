"""A thinking model served end to end: a Qwen3 replica with Qwen3.5's published template (which opens
`<think>` in every generation prompt unless `enable_thinking` is false). The thinking comes back in
`reasoning_content` and `reasoning`, plain and streamed, read by the OpenAI SDK; `content` holds the answer
alone; `chat_template_kwargs` and the server's default for it reach the template."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from tests.server.live import live_server
from tests.server.reasoning_model import write_thinking_model

ASK = [{"role": "user", "content": "2+2?"}]
CLOSE_ID = "441"  # `</think>` in the replica's vocabulary
# The replica's seeded weights rarely close the block: a bias on the closing tag, sampled with this seed,
# closes it once, mid-way (the tests assert both halves are there, so a change of weights shows).
THINKS = {"max_tokens": 24, "temperature": 2.0, "seed": 1, "presence_penalty": 2.0, "logit_bias": {CLOSE_ID: 14}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_thinking_model(tmp_path_factory.mktemp("qwen3-5-replica"))


@pytest.fixture(scope="module")
def server(model):
    with live_server("--model", str(model), "--device", "cpu", env={"PONDER_CACHE__NUM_BLOCKS": "256"}) as (base, _):
        yield base


def chat(base: str, **fields) -> dict:
    response = httpx.post(base + "/v1/chat/completions", json={"messages": ASK, **fields}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


def prompt_text(base: str, **fields) -> str:
    ids = httpx.post(base + "/tokenize", json={"messages": ASK, **fields}, timeout=60).json()["tokens"]
    return httpx.post(base + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]


def test_enable_thinking_false_ends_the_prompt_in_the_empty_block(server):
    assert prompt_text(server).endswith("<|im_start|>assistant\n<think>\n")
    assert prompt_text(server, chat_template_kwargs={"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_thinking_is_split_from_the_answer(server):
    raw = chat(server, reasoning_format="none", **THINKS)  # llama-server's: no parsing
    assert set(raw) == {"role", "content"} and raw["content"].count("</think>") == 1
    message = chat(server, **THINKS)
    assert message["reasoning_content"] and message["content"]
    assert message["reasoning"] == message["reasoning_content"]
    before, _, after = raw["content"].partition("</think>")
    assert (message["reasoning_content"], message["content"]) == (before, after.lstrip())
    assert "</think>" not in message["content"]


def test_a_prompt_with_thinking_off_gets_no_reasoning(server):
    message = chat(server, max_tokens=12, temperature=0, chat_template_kwargs={"enable_thinking": False})
    raw = chat(server, max_tokens=12, temperature=0, chat_template_kwargs={"enable_thinking": False},
               reasoning_format="none")
    assert message["reasoning_content"] is None and message["content"] == raw["content"]


def test_thinking_cut_short_is_all_reasoning_and_include_reasoning_false_leaves_it_out(server):
    cut = chat(server, max_tokens=6, temperature=0)
    assert cut["content"] is None and cut["reasoning_content"]
    assert chat(server, include_reasoning=False, **THINKS) == {
        "role": "assistant", "content": chat(server, **THINKS)["content"]}


def test_the_openai_sdk_reads_reasoning_content_plain_and_streamed(server):
    client = OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    name = client.models.list().data[0].id
    extra = {"presence_penalty": 2.0, "logit_bias": {CLOSE_ID: 14}}
    plain = client.chat.completions.create(model=name, messages=ASK, max_tokens=24, temperature=2.0,
                                           seed=1, extra_body=extra)
    message = plain.choices[0].message
    assert message.reasoning_content and message.content and message.reasoning == message.reasoning_content
    kinds, thought, answer = [], "", ""
    for chunk in client.chat.completions.create(model=name, messages=ASK, max_tokens=24,
                                                temperature=2.0, seed=1, stream=True, extra_body=extra):
        for choice in chunk.choices:
            delta = choice.delta
            if getattr(delta, "reasoning_content", None):
                assert delta.reasoning == delta.reasoning_content
                kinds.append("thinking")
                thought += delta.reasoning_content
            if delta.content:
                kinds.append("answer")
                answer += delta.content
    assert (thought, answer) == (message.reasoning_content, message.content)
    assert kinds == sorted(kinds, key=lambda kind: kind == "answer") and "thinking" in kinds


def test_the_servers_default_template_kwargs_parser_and_unknown_fields_settings(model, tmp_path):
    env = {"PONDER_CACHE__NUM_BLOCKS": "128", "PONDER_MODEL__CHAT_TEMPLATE_KWARGS": json.dumps(
        {"enable_thinking": False}), "PONDER_MODEL__REASONING_PARSER": "none", "PONDER_SERVER__UNKNOWN_FIELDS": "warn"}
    log = tmp_path / "server.log"
    with live_server("--model", str(model), "--device", "cpu", env=env, log_path=log) as (base, _):
        assert chat(base, max_tokens=2, frobnicate=1, messages=[{**ASK[0], "colour": "red"}])["content"] is not None
        assert "ignored fields no schema declares: frobnicate, messages.0.colour" in log.read_text()
        assert prompt_text(base).endswith("<think>\n\n</think>\n\n")
        assert prompt_text(base, chat_template_kwargs={"enable_thinking": True}).endswith("assistant\n<think>\n")
        message = chat(base, chat_template_kwargs={"enable_thinking": True}, **THINKS)
        assert set(message) == {"role", "content"} and "</think>" in message["content"]
        bad = httpx.post(base + "/v1/chat/completions", json={"messages": ASK, "chat_template_kwargs": {
            "tokenize": True}}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def completion(base: str, **fields) -> dict:
    response = httpx.post(base + "/v1/chat/completions", json={"messages": ASK, **fields}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_a_budget_of_k_gives_exactly_k_thinking_tokens_then_the_closing_text_and_the_answer(server, budget):
    # Unbudgeted, this model thinks past max_tokens (all 20 tokens are thinking).
    assert completion(server, max_tokens=20, temperature=0)["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": 20}
    body = completion(server, max_tokens=20, temperature=0, thinking_token_budget=budget, logprobs=True)
    tokens = [t["token"] for t in body["choices"][0]["logprobs"]["content"]]
    closing = tokens[budget:]
    assert closing[:4] == ["\n", "</think>", "\n", "\n"] and "</think>" not in tokens[:budget]
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": budget}
    assert body["usage"]["completion_tokens"] == 20  # max_tokens still bounds the whole
    message = body["choices"][0]["message"]
    raw = chat(server, max_tokens=20, temperature=0, thinking_token_budget=budget, reasoning_format="none")
    thought, tag, answer = raw["content"].partition("</think>")
    assert (message["reasoning_content"], message["content"]) == (thought, answer.lstrip()) and tag
    assert message["content"] and thought.endswith("\n")


def test_reasoning_effort_is_a_documented_budget(server):
    minimal = completion(server, max_tokens=8, temperature=0, reasoning_effort="minimal")
    assert minimal["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert minimal["choices"][0]["message"]["reasoning_content"] == "\n"
    low = completion(server, max_tokens=8, temperature=0, reasoning_effort="low")  # 1024: not reached here
    assert low["usage"]["completion_tokens_details"] == {"reasoning_tokens": 8}
    both = httpx.post(server + "/v1/chat/completions", json={"messages": ASK, "reasoning_effort": "low",
                                                             "thinking_token_budget": 3}, timeout=60)
    assert both.status_code == 400 and "not both" in both.json()["error"]["message"]


def test_a_json_schema_constrains_the_answer_after_free_thinking(server):
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    body = completion(server, max_tokens=40, temperature=0, thinking_token_budget=4,
                      response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    message = body["choices"][0]["message"]
    assert json.loads(message["content"]) in ({"a": "x"}, {"a": "y"})
    assert message["reasoning_content"] and "{" not in message["reasoning_content"]  # not held to the grammar
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}


def test_a_searchs_votes_read_the_answers_after_the_thinking(server):
    """Paths that think differently and answer alike vote together; a path that mentions the answer
    only in its thinking has no answer."""
    body = completion(server, max_tokens=24, temperature=2.0, seed=2, presence_penalty=2.0, frequency_penalty=2.0,
                      logit_bias={CLOSE_ID: 17}, n=8,
                      search={"strategy": "best_of_n", "n": 8, "verifier": "confidence", "select": "majority",
                              "answer_pattern": "(user)", "max_step_tokens": 24, "greedy_anchor": False})
    choices = body["choices"]
    for choice in choices:
        content = choice["message"]["content"] or ""
        assert choice["search"]["answer"] == ("user" if "user" in content else None), choice
    voters = [c["message"]["reasoning_content"] for c in choices if c["search"]["answer"] == "user"]
    assert choices[0]["search"]["answer"] == "user" and len(set(voters)) == len(voters) >= 2
    assert any("user" in (c["message"]["reasoning_content"] or "") and c["search"]["answer"] is None
               for c in choices)


def test_a_search_holds_each_path_to_the_budget_and_its_grammar_to_the_answer(server):
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    body = completion(server, max_tokens=40, temperature=1.0, seed=4, n=4, thinking_token_budget=3,
                      response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
                      search={"strategy": "best_of_n", "n": 4, "verifier": "confidence", "select": "majority"})
    for choice in body["choices"]:
        message = choice["message"]
        assert json.loads(message["content"]) in ({"a": "x"}, {"a": "y"})
        assert choice["search"]["answer"] == json.dumps(json.loads(message["content"]), sort_keys=True,
                                                        separators=(",", ":"))
        assert message["reasoning_content"].endswith("\n") and "{" not in message["reasoning_content"]
    # Greedy, the budget leaves the same three thinking tokens as a plain request's.
    plain = chat(server, max_tokens=40, temperature=0, thinking_token_budget=3,
                 response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    searched = completion(server, max_tokens=40, temperature=0, thinking_token_budget=3,
                          response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
                          search={"strategy": "best_of_n", "n": 2, "verifier": "confidence"})
    assert searched["choices"][0]["message"]["reasoning_content"] == plain["reasoning_content"]
