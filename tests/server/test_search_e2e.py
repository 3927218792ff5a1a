"""Search through the HTTP API with the openai SDK: every strategy, streaming, events, caps, cancel."""

import json
import time

import httpx
import openai
import pytest

from tests.server.live import live_server, metric

MESSAGES = [{"role": "user", "content": "w1 w2 w3"}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    env = {"PONDER_CACHE__NUM_BLOCKS": "4096", "PONDER_CACHE__BLOCK_SIZE": "4", "PONDER_SEARCH__MAX_PATHS": "16",
           "PONDER_SEARCH__MAX_TOTAL_TOKENS": "8000"}
    with live_server("--model", str(tiny_llama), "--device", "cpu", env=env) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def search(**kw):
    params = dict(strategy="beam", n=8, beam_width=4, max_steps=4, max_step_tokens=5, verifier="confidence")
    params.update(kw)
    return params


@pytest.mark.parametrize("strategy, select", [
    ("best_of_n", "best"), ("beam", "majority"), ("dvts", "weighted_majority"), ("dynamic_branching", "best"),
    ("particle_filtering", "best")])
@pytest.mark.parametrize("verifier", ["confidence", "judge"])
def test_each_strategy_returns_ranked_choices_with_scores(client, strategy, select, verifier):
    resp = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=24, temperature=1.0, seed=5, n=2,
        extra_body={"search": search(strategy=strategy, select=select, verifier=verifier)})
    assert resp.object == "chat.completion" and len(resp.choices) == 2
    body = resp.model_dump()
    for choice in body["choices"]:
        assert set(choice["search"]) == {"score", "step_scores", "answer"}
        assert 0.0 <= choice["search"]["score"] <= 1.0 and choice["search"]["step_scores"]
    summary = body["search"]
    assert summary["strategy"] == strategy and summary["paths_explored"] >= 8
    assert summary["tokens_generated"] >= summary["tokens_returned"] == resp.usage.completion_tokens
    if select == "best":
        assert choice["search"]["score"] <= body["choices"][0]["search"]["score"]


@pytest.mark.parametrize("greedy_anchor", [True, False])
def test_the_greedy_anchor_is_asked_for_and_reported_through_the_api(client, greedy_anchor):
    resp = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=24, temperature=1.0, seed=5,
        extra_body={"search": search(greedy_anchor=greedy_anchor)})
    summary = resp.model_dump()["search"]
    if greedy_anchor:  # the tiny model's greedy text is its most confident: no sampled path outranks it
        assert summary["answered_by_anchor"] is True and 0 < summary["anchor_tokens"] <= 24
    else:
        assert summary["answered_by_anchor"] is None and summary["anchor_tokens"] == 0


@pytest.mark.parametrize("strategy", ["beam", "particle_filtering"])
def test_streamed_search_concatenates_to_the_final_answer_with_events(client, server, strategy):
    kwargs = dict(messages=MESSAGES, max_tokens=24, temperature=1.0, seed=9,
                  extra_body={"search": search(n=4, beam_width=2, strategy=strategy)})
    model = client.models.list().data[0].id
    final = client.chat.completions.create(model=model, **kwargs).choices[0].message.content
    with httpx.stream("POST", server + "/v1/chat/completions", timeout=60, json={
            "model": model, "stream": True, "stream_options": {"include_search_events": True, "include_usage": True},
            **{k: v for k, v in kwargs.items() if k != "extra_body"}, **kwargs["extra_body"]}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == final
    events = [c["search"] for c in chunks if "search" in c and "step" in c["search"]]
    assert events and events[0]["step"] == 1 and "live_paths" in events[0]
    assert chunks[-2]["usage"] is not None or chunks[-1]["usage"] is not None


@pytest.mark.parametrize("extra, param", [
    ({"search": search(n=64)}, "search.n"),
    ({"search": search(n=16, max_steps=4), "max_tokens": 600}, "search.n"),  # 16 x 600 tokens > 8000
    ({"search": search(verifier="nope")}, "search.verifier"),
    ({"search": search(strategy="greedy")}, "search.strategy"),
    ({"search": {"n": 4, "bogus": 1}}, "search.bogus"),
])
def test_search_over_the_caps_or_malformed_is_a_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=200,
                                       extra_body=extra)
    assert err.value.body["param"] == param


@pytest.mark.parametrize("strategy", ["beam", "particle_filtering"])
def test_cancelled_search_frees_every_block(server, strategy):
    used = lambda: metric(server, "ponder_kv_blocks", tier="cpu", state="used")  # noqa: E731
    time.sleep(0.6)  # let statistics of earlier searches arrive (they are sent every 0.2 s)
    steps_before = metric(server, "ponder_search_steps_total")
    # 16 paths x 480 tokens: seconds of work even on a fast machine; the client leaves after 0.3 s.
    body = {"messages": MESSAGES, "max_tokens": 480, "stream": True, "ignore_eos": True,
            "search": search(n=16, max_steps=100, max_step_tokens=5, strategy=strategy)}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            time.sleep(0.3)
    deadline = time.monotonic() + 10
    while used() != 0:
        assert time.monotonic() < deadline, "a cancelled search kept its blocks"
        time.sleep(0.1)
    time.sleep(0.5)
    assert metric(server, "ponder_search_steps_total") == steps_before  # it never finished: it was aborted
    assert metric(server, "ponder_search_requests_total", strategy=strategy) >= 1
