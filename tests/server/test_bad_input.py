"""Malformed and abusive requests: each is an OpenAI-shaped 4xx, never a 5xx or FastAPI's 422 shape.
Hand-written cases first, then a schemathesis fuzz over the server's own OpenAPI schema."""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.server.live import live_server

MESSAGES = [{"role": "user", "content": "w1 w2 w3"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# Small caps, so that fuzzed requests stay cheap and the cap checks are easy to cross.
ENV = {"PONDER_CACHE__NUM_BLOCKS": "512", "PONDER_CACHE__BLOCK_SIZE": "4", "PONDER_SERVER__LOG_LEVEL": "WARNING",
       "PONDER_SERVER__MAX_BODY_BYTES": str(1 << 20), "PONDER_LIMITS__MAX_N": "2",
       "PONDER_LIMITS__MAX_STOP_STRINGS": "8", "PONDER_SEARCH__MAX_PATHS": "4", "PONDER_SEARCH__MAX_BEAM_WIDTH": "2",
       "PONDER_SEARCH__MAX_STEPS": "3", "PONDER_SEARCH__MAX_TOTAL_TOKENS": "64"}
FUZZ_EXAMPLES = 40  # per operation and mode
SEARCH = {"strategy": "beam", "n": 2, "beam_width": 2, "max_steps": 2, "max_step_tokens": 4, "verifier": "confidence"}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    env = {**ENV, "PONDER_RESPONSES__PATH": str(tmp_path_factory.mktemp("responses") / "responses.sqlite3")}
    with live_server("--model", str(tiny_llama), "--device", "cpu", "--max-model-len", "32", env=env) as (base, _):
        yield base


def assert_openai_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text[:500]
    body = r.json()
    assert list(body) == ["error"], body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == ("invalid_request_error" if status in (400, 405, 413) else error["type"])
    if param != "any":
        assert error["param"] == param, error
    return error


def post(server: str, body: dict, path: str = CHAT) -> httpx.Response:
    # json.dumps escapes non-ASCII, so lone surrogates travel as the `\udXXX` escapes a client could send.
    return post_raw(server, json.dumps(body).encode(), path=path)


def post_raw(server: str, content: bytes, content_type: str | None = "application/json", path: str = CHAT,
             **headers: str) -> httpx.Response:
    if content_type is not None:
        headers["content-type"] = content_type
    return httpx.post(server + path, content=content, headers=headers, timeout=30)


# -- the body is not a JSON object --------------------------------------------------------------

@pytest.mark.parametrize("raw", [b'{"messages": [', b"", b"{'messages': []}", b'{"messages": [}]}', b"nul"])
def test_invalid_json(server, raw):
    assert_openai_error(post_raw(server, raw), 400)


def test_invalid_json_says_so(server):
    error = assert_openai_error(post_raw(server, b'{"messages": ['), 400, None)
    assert "JSON" in error["message"]


@pytest.mark.parametrize("raw", [b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', b"\xc3\x28", b"\xef\xbb"])
def test_invalid_utf8(server, raw):
    assert_openai_error(post_raw(server, raw), 400)


@pytest.mark.parametrize("raw", [b"[1, 2]", b"5", b'"hello"', b"null", b"[" * 100_000 + b"]" * 100_000])
def test_json_that_is_not_an_object(server, raw):
    assert_openai_error(post_raw(server, raw), 400)


@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty", "presence_penalty"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers(server, field, value):
    raw = f'{{"messages": {json.dumps(MESSAGES)}, "max_tokens": 2, "{field}": {value}}}'.encode()
    assert_openai_error(post_raw(server, raw), 400, field)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "application/xml",
                                          "multipart/form-data; boundary=x", None])
def test_wrong_content_types(server, content_type):
    assert_openai_error(post_raw(server, json.dumps({"messages": MESSAGES}).encode(), content_type), 400)


def test_form_fields_are_not_a_request(server):
    r = httpx.post(server + CHAT, data={"messages": "w1"}, timeout=30)
    assert_openai_error(r, 400)
    r = httpx.post(server + CHAT, files={"messages": ("m.json", b"[]")}, timeout=30)
    assert_openai_error(r, 400)


def test_a_body_over_the_limit_is_413_announced_or_streamed(server):
    big = json.dumps({"messages": [{"role": "user", "content": "w1 " * 3_500_000}]}).encode()
    assert len(big) > 10_000_000
    assert_openai_error(post_raw(server, big), 413)

    def chunks():
        for start in range(0, len(big), 1 << 16):
            yield big[start:start + (1 << 16)]

    # No Content-Length: the limit is enforced while the body is read.
    assert_openai_error(httpx.post(server + CHAT, content=chunks(), headers={"content-type": "application/json"},
                                   timeout=30), 413)
    for content in (big, chunks()):  # Anthropic's route answers in Anthropic's shape
        r = httpx.post(server + "/v1/messages", content=content, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 413 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "request_too_large", r.json()


def test_wrong_method_and_route(server):
    assert_openai_error(httpx.get(server + CHAT), 405)
    assert_openai_error(httpx.post(server + "/v1/chat/completion", json={"messages": MESSAGES}), 404)


# -- the fields are wrong -----------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": None}, "messages"),
    ({"messages": [{}]}, "messages.0.role"),
    ({"messages": [{"content": "w1"}]}, "messages.0.role"),
    ({"messages": [{"role": "wizard", "content": "w1"}]}, "messages.0.role"),
    ({"messages": [{"role": "USER", "content": "w1"}]}, "messages.0.role"),
    ({"messages": [{"role": None, "content": "w1"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, None),
    ({"messages": MESSAGES, "n": 3}, "n"),
    ({"messages": MESSAGES, "n": 10**6}, "n"),
    ({"messages": MESSAGES, "n": 10**30}, "n"),
    ({"messages": MESSAGES, "n": 0}, "n"),
    ({"messages": MESSAGES, "max_tokens": 10**9}, "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": 10**30}, "max_tokens"),
    ({"messages": MESSAGES, "max_completion_tokens": 10**9}, "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ({"messages": MESSAGES, "stop": [f"w{i}" for i in range(5000)]}, "stop"),
    ({"messages": MESSAGES, "stop": ["w" * 100_000]}, "stop"),
    ({"messages": MESSAGES, "top_p": 0}, "top_p"),
    ({"messages": MESSAGES, "top_k": 10**30}, "top_k"),
    ({"messages": MESSAGES, "seed": 2**64}, "seed"),
    ({"messages": MESSAGES, "stop_token_ids": [10**30]}, "stop_token_ids"),
    ({"messages": MESSAGES, "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MESSAGES, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"messages": MESSAGES, "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"messages": MESSAGES, "prompt_logprobs": 1, "search": SEARCH, "max_tokens": 8}, "prompt_logprobs"),
    ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, None),
    ({"messages": MESSAGES, "model": "\ud800"}, "model"),
    ({"messages": MESSAGES, "stop": "\udfff"}, "stop"),
    ({"messages": [{"role": "user", "content": "w1 \ud800"}]}, None),
    ({"messages": [{"role": "user", "content": " ".join(["w1"] * 200)}]}, None),  # longer than the context
])
def test_bad_chat_fields(server, body, param):
    error = assert_openai_error(post(server, body), 400)
    if param is not None:
        assert error["param"] and error["param"].startswith(param), error


@pytest.mark.parametrize("body, param", [
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10**30]}, "prompt"),
    ({"prompt": [[1, 2], [10**6]]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "w1", "echo": True, "search": SEARCH}, "echo"),
    ({"prompt": "w1", "prompt_logprobs": 1, "search": SEARCH}, "prompt_logprobs"),
    ({"prompt": "w1", "logprobs": 50}, "logprobs"),
    ({"prompt": "w1", "logprobs": 21, "echo": True}, "logprobs"),
    ({"prompt": "w1", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "w1", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "w1", "max_tokens": -1, "echo": True}, "max_tokens"),
    ({"prompt": "w1", "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": ["w1"] * 3, "n": 3}, "n"),
])
def test_bad_completion_fields(server, body, param):
    error = assert_openai_error(post(server, body, COMPLETIONS), 400)
    if param is not None:
        assert error["param"] and error["param"].startswith(param), error


@pytest.mark.parametrize("search, param", [
    ({**SEARCH, "n": 5}, "search.n"),
    ({**SEARCH, "n": 10**30}, "search.n"),
    ({**SEARCH, "beam_width": 3}, "search.beam_width"),
    ({**SEARCH, "max_steps": 4}, "search.max_steps"),
    ({**SEARCH, "n": 4}, "search.n"),  # 4 paths x 20 tokens > 64
    ({**SEARCH, "max_step_tokens": 10**30}, "search.max_step_tokens"),
    ({**SEARCH, "granularity": 0}, "search.granularity"),
    ({**SEARCH, "verifier": "oracle"}, "search.verifier"),
    ({**SEARCH, "strategy": "mcts"}, "search.strategy"),
    ({**SEARCH, "budget": 1}, "search.budget"),
    ({**SEARCH, "step_delimiter": ""}, "search.step_delimiter"),
    ({**SEARCH, "strategy": "deepconf", "deepconf_warmup": 3}, "search.deepconf_warmup"),  # more than n
    ({**SEARCH, "strategy": "deepconf", "deepconf_warmup": 0}, "search.deepconf_warmup"),
    ({**SEARCH, "strategy": "deepconf", "deepconf_eta": 0}, "search.deepconf_eta"),
    ({**SEARCH, "strategy": "deepconf", "deepconf_eta": 101}, "search.deepconf_eta"),
    ({**SEARCH, "strategy": "deepconf", "deepconf_window": 0}, "search.deepconf_window"),
    ({**SEARCH, "answer_pattern": "(("}, None),
    ("beam", "search"),
])
def test_search_budgets_over_the_caps_or_malformed(server, search, param):
    error = assert_openai_error(post(server, {"messages": MESSAGES, "max_tokens": 20, "search": search}), 400)
    if param is not None:
        assert error["param"] and error["param"].startswith(param), error


def test_search_without_max_tokens_is_capped_by_the_context_length(server):
    # 3 paths x 32 tokens (the context length) > 64
    error = assert_openai_error(post(server, {"messages": MESSAGES, "search": {**SEARCH, "n": 3}}), 400)
    assert error["param"] == "search.n" and "96" in error["message"] and "64" in error["message"]


@pytest.mark.parametrize("extra", [
    {"temperature": 1e-300}, {"temperature": 5e-324}, {"repetition_penalty": 1e-300},
    {"repetition_penalty": 1e-300, "temperature": 0.5}, {"top_p": 1e-300}, {"min_p": 1.0, "top_p": 5e-324},
    {"temperature": 1e-300, "search": SEARCH}, {"repetition_penalty": 1e-300, "search": SEARCH}])
def test_extreme_but_valid_sampling_values_are_answered(server, extra):
    r = post(server, {"messages": MESSAGES, "max_tokens": 4, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text[:500]
    assert r.json()["choices"][0]["finish_reason"] == "length"


# -- the agent APIs: malformed items and blocks ---------------------------------------------------

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2, 2), st.sampled_from(["", "x", "user", "assistant"]))
_KEYS = ["type", "role", "content", "call_id", "name", "arguments", "output", "id", "text", "input", "tool_use_id"]
_TYPES = ["message", "function_call", "function_call_output", "reasoning", "item_reference", "input_text",
          "output_text", "input_image", "text", "tool_use", "tool_result", "thinking", "image", "document"]
_PART = st.dictionaries(st.sampled_from(_KEYS), st.one_of(_SCALARS, st.sampled_from(_TYPES)), max_size=4)
_ITEM = st.dictionaries(st.sampled_from(_KEYS), st.one_of(_SCALARS, st.sampled_from(_TYPES), st.lists(_PART, max_size=2)),
                        max_size=5)


@given(items=st.lists(st.one_of(_ITEM, _SCALARS), min_size=1, max_size=3))
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_malformed_input_items_are_400s_naming_the_input(server, items):
    r = post(server, {"input": items, "max_output_tokens": 2}, path="/v1/responses")
    assert r.status_code in (200, 400), r.text[:500]
    if r.status_code == 400:
        assert r.json()["error"]["param"].startswith("input"), r.json()


@given(blocks=st.lists(st.one_of(_ITEM, _SCALARS), min_size=1, max_size=3))
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_malformed_content_blocks_are_400s_naming_the_message(server, blocks):
    model = httpx.get(server + "/v1/models").json()["data"][0]["id"]  # Anthropic's requests name the model
    r = post(server, {"model": model, "messages": [{"role": "user", "content": blocks}], "max_tokens": 2},
             path="/v1/messages")
    assert r.status_code in (200, 400), r.text[:500]
    if r.status_code == 400:
        assert r.json()["error"]["message"].startswith("messages.0"), r.json()


def test_the_server_still_answers_after_all_that(server):
    r = post(server, {"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True, "search": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# -- fuzzing ------------------------------------------------------------------------------------

OPERATIONS = [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/rewards"),
              ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses"),
              ("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}"),
              ("GET", "/v1/responses/{response_id}/input_items")]


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server + "/openapi.json")


def test_the_schema_has_exactly_the_fuzzed_operations(api_schema):
    assert {(r.ok().method.upper(), r.ok().path) for r in api_schema.get_all_operations()} == set(OPERATIONS)


@pytest.mark.parametrize("method, path, mode", [
    *((method, path, GenerationMode.POSITIVE) for method, path in OPERATIONS),
    # GET /v1/models takes no input, so it has no invalid one.
    *((method, path, GenerationMode.NEGATIVE) for method, path in OPERATIONS if method == "POST")])
def test_fuzzed_requests_never_get_a_5xx(api_schema, method, path, mode):
    # Built here rather than with schemathesis' pytest plugin: the schema comes from a live server.
    @given(case=api_schema[path][method].as_strategy(generation_mode=mode))
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call(timeout=30)
        assert response.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {response.text[:500]}"
        if response.status_code >= 400 and path.startswith("/v1/messages"):  # Anthropic's error shape
            body = response.json()
            assert list(body) == ["type", "error"] and set(body["error"]) == {"type", "message"}, body
        elif response.status_code >= 400:
            body = response.json()
            assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body

    check()
