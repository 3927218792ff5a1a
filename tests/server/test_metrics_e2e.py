"""/metrics after plain and search requests: counters move by exactly what the responses report."""

import time

import httpx
import pytest

from tests.server.live import live_server, metric

MESSAGES = [{"role": "user", "content": "w1 w2 w3"}]
NUM_BLOCKS = 512


@pytest.fixture(scope="module")
def server(tiny_llama):
    env = {"PONDER_CACHE__NUM_BLOCKS": str(NUM_BLOCKS), "PONDER_CACHE__BLOCK_SIZE": "4"}
    with live_server("--model", str(tiny_llama), "--device", "cpu", env=env) as (base, _):
        yield base


def settle(server, name, expected, **labels):
    """Runtime statistics arrive every 0.2 s: wait for a counter to reach its value."""
    deadline = time.monotonic() + 5
    while True:
        value = metric(server, name, **labels)
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def test_plain_request_moves_token_and_request_counters(server):
    before = {k: metric(server, "ponder_tokens_total", kind=k) for k in ("prompt", "generated", "returned", "cached")}
    requests_before = metric(server, "ponder_requests_total", endpoint="chat", status="200", default=0)
    body = {"messages": MESSAGES, "max_tokens": 7, "temperature": 0, "ignore_eos": True, "n": 2}
    usage = httpx.post(server + "/v1/chat/completions", json=body).json()["usage"]
    assert usage["completion_tokens"] == 14
    assert settle(server, "ponder_tokens_total", before["prompt"] + usage["prompt_tokens"], kind="prompt") == \
        before["prompt"] + usage["prompt_tokens"]
    assert settle(server, "ponder_tokens_total", before["generated"] + 14, kind="generated") == before["generated"] + 14
    assert metric(server, "ponder_tokens_total", kind="returned") == before["returned"] + 14
    assert metric(server, "ponder_requests_total", endpoint="chat", status="200") == requests_before + 1
    assert metric(server, "ponder_request_latency_seconds_count") >= 1
    assert metric(server, "ponder_time_to_first_token_seconds_count") >= 1
    assert metric(server, "ponder_runtime_up") == 1


def test_kv_blocks_account_for_the_whole_pool_and_prefix_hits(server):
    long = [{"role": "user", "content": " ".join(f"w{i}" for i in range(20))}]
    hits_before = metric(server, "ponder_kv_prefix_hit_tokens_total")
    first = httpx.post(server + "/v1/chat/completions", json={"messages": long, "max_tokens": 2}).json()
    second = httpx.post(server + "/v1/chat/completions", json={"messages": long, "max_tokens": 2}).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and cached > 0
    assert settle(server, "ponder_kv_prefix_hit_tokens_total", hits_before + cached) == hits_before + cached
    settle(server, "ponder_kv_blocks", 0, tier="cpu", state="used")  # statistics lag by up to 0.2 s
    states = {s: metric(server, "ponder_kv_blocks", tier="cpu", state=s) for s in ("used", "cached", "free")}
    assert states["used"] == 0 and sum(states.values()) == NUM_BLOCKS and states["cached"] > 0


def test_search_request_moves_search_counters(server):
    before_requests = metric(server, "ponder_search_requests_total", strategy="beam", default=0)
    before_paths = metric(server, "ponder_search_paths_total")
    before_steps = metric(server, "ponder_search_steps_total")
    body = {"messages": MESSAGES, "max_tokens": 20, "seed": 3,
            "search": {"strategy": "beam", "n": 4, "beam_width": 2, "max_steps": 3, "max_step_tokens": 4,
                       "verifier": "judge"}}
    summary = httpx.post(server + "/v1/chat/completions", json=body, timeout=60).json()["search"]
    assert settle(server, "ponder_search_steps_total", before_steps + summary["steps"]) == before_steps + summary["steps"]
    assert metric(server, "ponder_search_paths_total") == before_paths + summary["paths_explored"]
    assert metric(server, "ponder_search_requests_total", strategy="beam") == before_requests + 1
    assert metric(server, "ponder_verifier_seconds_count") >= summary["verifier_calls"] > 0

