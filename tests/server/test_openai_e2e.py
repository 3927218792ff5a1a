"""End to end: `ponder serve` on a tiny model, driven with the official openai SDK and raw HTTP."""

import subprocess
import sys
import time

import httpx
import openai
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.runtime.engine_helpers import hf_greedy
from tests.server.live import ROOT, live_server, metric

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "w1 w2 w3"}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    with live_server("--model", str(tiny_llama), "--api-key", KEY, "--device", "cpu",
                     env={"PONDER_CACHE__NUM_BLOCKS": "256", "PONDER_CACHE__BLOCK_SIZE": "4"}) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def expected(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    ids = hf_greedy(model, prompt, 8)
    return {"prompt_tokens": len(prompt), "ids": ids, "text": tok.decode(ids, skip_special_tokens=True), "tok": tok}


def test_models_and_health(server, client):
    assert httpx.get(server + "/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [models.data[0].id] and models.data[0].id.startswith("tiny-llama")
    [entry] = httpx.get(server + "/v1/models", headers=AUTH).json()["data"]
    assert (entry["quantize"], entry["block_types"]) == ("float", [])  # float weights in ponder's float kernel, no GGUF blocks
    assert entry["sampling_defaults"] == {}  # its generation_config.json holds token ids, no sampling field
    # A float llama on a CPU: the lean decoder whose decode steps are one float-kernel call (runtime.model.paths).
    assert entry["paths"] == {"family": "llama", "layers": "float_kernel", "linear": "float_kernel",
                              "attention": "cpu_kernel"}


def test_chat_non_streaming_matches_greedy_reference(client, expected):
    resp = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES,
                                          max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected["text"]
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == expected["prompt_tokens"]
    assert resp.usage.completion_tokens == 8 and resp.usage.total_tokens == expected["prompt_tokens"] + 8


def test_streaming_with_usage_concatenates_to_the_same_text(client, expected):
    model = client.models.list().data[0].id
    chunks = list(client.chat.completions.create(
        messages=MESSAGES, model=model, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["text"]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_prefix_cache_reports_cached_tokens(client):
    model = client.models.list().data[0].id
    long = [{"role": "user", "content": " ".join(f"w{i}" for i in range(30))}]
    client.chat.completions.create(messages=long, model=model, max_tokens=2, temperature=0)
    again = client.chat.completions.create(messages=long, model=model, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.usage.prompt_tokens_details.cached_tokens % 4 == 0


def test_n_choices_stop_and_logprobs(client, expected):
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(messages=MESSAGES, model=model, max_tokens=6, n=3, temperature=1.0,
                                          seed=7, logprobs=True, top_logprobs=2)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for choice in resp.choices:
        assert 1 <= len(choice.logprobs.content) <= 6
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
    again = client.chat.completions.create(messages=MESSAGES, model=model, max_tokens=6, n=3, temperature=1.0,
                                           seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in resp.choices]
    words = expected["text"].split(" ")
    stop = words[3]
    cut = client.chat.completions.create(messages=MESSAGES, model=model, max_tokens=8, temperature=0,
                                         stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].message.content == expected["text"][:expected["text"].index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_text_completions_with_token_and_string_prompts(client):
    model = client.models.list().data[0].id
    resp = client.completions.create(model=model, prompt=["w1 w2", "w3"], max_tokens=4, temperature=0,
                                     logprobs=1, extra_body={"ignore_eos": True})
    assert resp.object == "text_completion" and [c.index for c in resp.choices] == [0, 1]
    assert all(len(c.logprobs.tokens) == 4 for c in resp.choices)
    ids = client.completions.create(model=model, prompt=[1, 5, 6], max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 3


def _error(server, path, body, headers=AUTH, raw=None):
    if raw is not None:
        r = httpx.post(server + path, content=raw, headers={**headers, "content-type": "application/json"})
    else:
        r = httpx.post(server + path, json=body, headers=headers)
    payload = r.json()
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}
    return r.status_code, payload["error"]


@pytest.mark.parametrize("body, status, param", [
    ({"messages": []}, 400, "messages"),
    ({}, 400, "messages"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": MESSAGES, "max_tokens": -5}, 400, "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": 10**9}, 400, "max_tokens"),
    ({"messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
    ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, 400, None),
    ({"messages": MESSAGES, "model": "no-such-model"}, 404, "model"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ({"messages": MESSAGES, "n": 10_000}, 400, "n"),
])
def test_user_mistakes_get_openai_errors(server, body, status, param):
    code, error = _error(server, "/v1/chat/completions", body)
    assert code == status, error
    assert error["param"] == param or (param and error["param"].startswith(param))


def test_malformed_json_and_context_overflow(server):
    code, error = _error(server, "/v1/chat/completions", None, raw=b'{"messages": [')
    assert code == 400 and "JSON" in error["message"]
    long_prompt = " ".join(["w1"] * 600)
    code, error = _error(server, "/v1/completions", {"prompt": long_prompt, "max_tokens": 1})
    assert code == 400 and error["code"] == "context_length_exceeded"


def test_api_key_required_except_health(server):
    assert httpx.get(server + "/v1/models").status_code == 401
    assert httpx.get(server + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(server + "/metrics").status_code == 401
    assert httpx.get(server + "/health").status_code == 200
    code, error = _error(server, "/v1/chat/completions", {"messages": MESSAGES}, headers={})
    assert code == 401 and error["type"] == "authentication_error"
    assert httpx.get(server + "/v1/nothing-here", headers=AUTH).status_code == 404


def test_dropped_stream_frees_every_block(server):
    used = lambda: metric(server, "ponder_kv_blocks", AUTH, tier="cpu", state="used")  # noqa: E731
    generated = lambda: metric(server, "ponder_tokens_total", AUTH, kind="generated")  # noqa: E731
    before = generated()
    body = {"messages": MESSAGES, "max_tokens": 400, "stream": True, "n": 4, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server + "/v1/chat/completions", json=body, headers=AUTH) as r:
            lines = r.iter_lines()
            seen = 0
            for line in lines:
                if line.startswith("data: {"):
                    seen += 1
                if seen >= 10:
                    break
    assert seen >= 10
    deadline = time.monotonic() + 10
    while used() != 0:
        assert time.monotonic() < deadline, "blocks of a dropped stream were not freed"
        time.sleep(0.1)
    time.sleep(0.5)
    assert generated() - before < 4 * 400  # stopped early: the request was aborted, not finished


def test_a_model_that_cannot_load_ends_the_server_naming_why(tmp_path):
    """Until the model loads /health answers 503; a load that fails ends `ponder serve` with status 1 and
    the loader's message on its last line (docs/models.md), not a server answering 503 for ever."""
    out = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", str(tmp_path / "missing"),
                          "--port", "0", "--device", "cpu"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert out.stderr.splitlines()[-1] == (f"ponder: cannot load the model: ModelNotFound: no model at "
                                           f"{tmp_path / 'missing'}: pass a model directory, a .gguf file or a "
                                           "cached hub id")
