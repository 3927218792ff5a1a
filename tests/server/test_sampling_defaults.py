"""The model author's sampling defaults (model.generation_config): a checkpoint's generation_config.json
values apply where a request leaves the field unset, a request's own value wins, `/v1/models` shows
what applies, and `none` turns them off."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from runtime.wire.params import SamplingParams
from server.schemas import ChatCompletionRequest, CompletionRequest
from tests.conftest import build_model
from tests.runtime.model.test_generation_config import QWEN25_DEFAULTS, QWEN25_INSTRUCT
from tests.server.live import live_server

MESSAGES = [{"role": "user", "content": "w1 w2 w3"}]
PONDER_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def sampled(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in PONDER_DEFAULTS}


# ---------------------------------------------------------------------------------------------
# The server's side: which value each field of the runtime's SamplingParams takes


def test_unset_fields_take_the_authors_values():
    chat = ChatCompletionRequest(messages=MESSAGES)
    assert sampled(chat.to_sampling(QWEN25_DEFAULTS)) == {**PONDER_DEFAULTS, **QWEN25_DEFAULTS}
    completion = CompletionRequest(prompt="w1", n=2, seed=3)
    assert sampled(completion.to_sampling(QWEN25_DEFAULTS)) == {**PONDER_DEFAULTS, **QWEN25_DEFAULTS}


def test_a_field_sent_as_null_is_a_field_not_sent():
    """OpenAI's sampling fields are nullable, null meaning the default: the author's values apply, and
    the request is otherwise the one that left them out."""
    nulls = {name: None for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "n",
                                     "presence_penalty", "frequency_penalty", "stream", "logprobs",
                                     "parallel_tool_calls")}
    chat = ChatCompletionRequest.model_validate({"messages": MESSAGES, **nulls})
    assert chat == ChatCompletionRequest.model_validate({"messages": MESSAGES})
    assert sampled(chat.to_sampling(QWEN25_DEFAULTS)) == {**PONDER_DEFAULTS, **QWEN25_DEFAULTS}
    completion = CompletionRequest.model_validate({"prompt": "w1", "echo": None, "temperature": None})
    assert completion == CompletionRequest.model_validate({"prompt": "w1"})


def test_a_field_the_request_sends_wins_even_at_ponders_default():
    chat = ChatCompletionRequest.model_validate({"messages": MESSAGES, "temperature": 1.0, "top_k": -1,
                                                 "min_p": 0.1})
    assert sampled(chat.to_sampling(QWEN25_DEFAULTS)) == {
        "temperature": 1.0, "top_p": 0.8, "top_k": 0, "min_p": 0.1, "repetition_penalty": 1.05}
    greedy = CompletionRequest.model_validate({"prompt": "w1", "temperature": 0, "search": {"n": 2}})
    assert greedy.to_sampling(QWEN25_DEFAULTS).temperature == 0.0


def test_without_defaults_ponders_own_apply():
    assert sampled(ChatCompletionRequest(messages=MESSAGES).to_sampling()) == PONDER_DEFAULTS
    assert sampled(ChatCompletionRequest(messages=MESSAGES).to_sampling({})) == PONDER_DEFAULTS


# ---------------------------------------------------------------------------------------------
# Served: a tiny model folder carrying Qwen2.5-Instruct's generation_config.json


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory):
    directory = build_model(tmp_path_factory.mktemp("tiny-qwen2-instruct"), "qwen2", seed=1)
    path = directory / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **QWEN25_INSTRUCT,
                                "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    return directory


def serve(model, *args: str, log_path=None):
    return live_server("--model", str(model), "--device", "cpu", "--max-model-len", "128", *args,
                       env={"PONDER_CACHE__NUM_BLOCKS": "128", "PONDER_CACHE__BLOCK_SIZE": "4"}, timeout=600,
                       log_path=log_path)


def tokens(base: str, **fields) -> list[list[int]]:
    body = {"messages": MESSAGES, "max_tokens": 24, "seed": 7, "n": 3, "ignore_eos": True, **fields}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [c["message"]["content"] for c in r.json()["choices"]]


def models(base: str) -> dict:
    r = httpx.get(base + "/v1/models", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["data"][0]


def test_served_with_the_authors_defaults(qwen_like, tmp_path):
    log = tmp_path / "server.log"
    with serve(qwen_like, log_path=log) as (base, _):
        assert models(base)["sampling_defaults"] == QWEN25_DEFAULTS
        authors = tokens(base)
        assert authors == tokens(base, **QWEN25_DEFAULTS)
        own = tokens(base, temperature=1.0)
        assert own == tokens(base, **{**QWEN25_DEFAULTS, "temperature": 1.0})
        assert own != authors
        assert tokens(base, **PONDER_DEFAULTS) != authors
        sdk = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)  # sends only what is set
        reply = sdk.chat.completions.create(model=models(base)["id"], messages=MESSAGES, max_tokens=24, seed=7, n=3,
                                            extra_body={"ignore_eos": True})
        assert [c.message.content for c in reply.choices] == authors
        logged = log.read_text()
    assert logged.count("default sampling parameters from the model's generation_config.json: temperature=0.7, "
                        "top_p=0.8, top_k=20, repetition_penalty=1.05") == 1


def test_none_keeps_ponders_own(qwen_like):
    with serve(qwen_like, "--generation-config", "none") as (base, _):
        assert models(base)["sampling_defaults"] == {}
        assert tokens(base) == tokens(base, **PONDER_DEFAULTS)
