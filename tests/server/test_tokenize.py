"""vLLM's POST /tokenize and /detokenize, checked against the tiny model's Hugging Face tokenizer."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.server.live import live_server

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "system", "content": "w5"}, {"role": "user", "content": "w1 w2 w3"}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    with live_server("--model", str(tiny_llama), "--api-key", KEY, "--device", "cpu", "--max-model-len", "64",
                     env={"PONDER_CACHE__NUM_BLOCKS": "64", "PONDER_CACHE__BLOCK_SIZE": "4"}, timeout=600) as (base, _):
        yield base


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def post(server, path, body, headers=AUTH):
    return httpx.post(server + path, json=body, headers=headers, timeout=30)


@pytest.mark.parametrize("text", ["w1 w2 w3", "w7 + w8 . 1 2", "zz w1 <unk>"])
def test_tokenize_a_prompt(server, tok, text):
    r = post(server, "/tokenize", {"prompt": text})
    assert r.status_code == 200, r.text
    expected = tok.encode(text)  # add_special_tokens defaults to true, as in vLLM
    assert r.json() == {"tokens": expected, "count": len(expected), "max_model_len": 64}
    r = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert r.json()["tokens"] == tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_messages_through_the_chat_template(server, tok, add_generation_prompt):
    r = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": add_generation_prompt})
    assert r.status_code == 200, r.text
    expected = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True)
    expected = list(expected["input_ids"]) if hasattr(expected, "keys") else list(expected)
    assert r.json()["tokens"] == expected and r.json()["count"] == len(expected)


def test_tokenize_counts_what_a_chat_request_is_charged(server):
    r = post(server, "/tokenize", {"messages": MESSAGES})
    chat = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == r.json()["count"]


@pytest.mark.parametrize("ids", [[1, 4, 5, 6, 2], [70, 71, 72], []])
def test_detokenize(server, tok, ids):
    r = post(server, "/detokenize", {"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tok.decode(ids)}


def test_round_trip(server):
    ids = post(server, "/tokenize", {"prompt": "w9 w10 w11", "add_special_tokens": False}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": "w9 w10 w11"}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"prompt": "w1", "messages": MESSAGES}, 400, None),
    ("/tokenize", {"prompt": "w1", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "w1"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_requests_are_openai_shaped(server, path, body, status, param):
    import json

    r = httpx.post(server + path, content=json.dumps(body), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] and error["param"].startswith(param), error


def test_same_auth_as_the_v1_routes(server):
    for path, body in [("/tokenize", {"prompt": "w1"}), ("/detokenize", {"tokens": [4]})]:
        assert post(server, path, body, headers={}).status_code == 401
        assert post(server, path, body, headers={"Authorization": "Bearer wrong"}).status_code == 401
