"""Two `ponder serve` replicas behind the Shepherd Model Gateway (PyPI `smg`, cache_aware routing), all on
loopback: what a client sees through the router is what it sees from a replica directly; requests that
share a long prefix stay on the replica holding it; a killed replica's traffic moves to the other.

The tests run in file order on one router: the last one kills a replica."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from tests.server.live import free_port, live_server, metric, stop

SMG = Path(sys.executable).parent / "smg"
if not SMG.exists():
    pytest.skip("smg (the Shepherd Model Gateway) is not installed (make install: the `clients` extra)",
                allow_module_level=True)

ENV = {"PONDER_CACHE__NUM_BLOCKS": "512", "PONDER_CACHE__BLOCK_SIZE": "4"}
HIT = "ponder_kv_prefix_hit_tokens_total"
ROUTED = "x-smg-routed-worker-id"  # the replica smg sent a request to
SEARCH = {"strategy": "beam", "n": 4, "beam_width": 2, "max_steps": 2, "max_step_tokens": 4, "verifier": "confidence"}
# Fields that differ between two runs of the same request: ids, clocks and timings.
VOLATILE = {"id", "created", "seconds_generating", "seconds_verifying"}


def start_router(workers: list[str], policy: str, log) -> tuple[str, subprocess.Popen]:
    """smg on loopback (its Prometheus listener too) in front of `workers`, once it sees all of them healthy."""
    port = free_port()
    proc = subprocess.Popen(
        [str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
         "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
         "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1", "--log-level", "warn"],
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"smg exited with {proc.returncode}")
        try:
            if httpx.get(base + "/readiness", timeout=2).json().get("healthy_workers") == len(workers):
                return base, proc
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            stop(proc)
            raise TimeoutError("smg did not see every replica healthy")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def fleet(tiny_llama):
    """{"router": url, "replicas": {url: Popen}}."""
    with ExitStack() as stack:
        # Startup takes minutes on a busy 2-core machine.
        replicas = dict(stack.enter_context(
            live_server("--model", str(tiny_llama), "--device", "cpu", env=ENV, timeout=300)) for _ in range(2))
        log = stack.enter_context(tempfile.TemporaryFile(mode="w+"))
        router, proc = start_router(list(replicas), "cache_aware", log)
        stack.callback(stop, proc)
        yield {"router": router, "replicas": replicas, "model": tiny_llama.name}


def strip(value):
    """`value` without the fields that differ from run to run."""
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120)


def events(base: str, path: str, body: dict) -> tuple[list, str | None]:
    """A stream's `data:` payloads (parsed; "[DONE]" kept as is) and the replica it was routed to."""
    out = []
    with httpx.stream("POST", base + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
        return out, r.headers.get(ROUTED)


def other(fleet, url: str) -> str:
    [rest] = [u for u in fleet["replicas"] if u != url]
    return rest


def words(start: int, count: int) -> str:
    return " ".join(f"w{(start + 7 * i) % 60}" for i in range(count))


def test_search_and_streams_pass_through_unchanged(fleet):
    """The same request through the router and directly (to the replica the router did not pick, so both
    run on a cold prefix cache) gives the same body and the same chunks, field for field."""
    model = fleet["model"]
    chat = {"model": model, "messages": [{"role": "user", "content": words(3, 6)}], "max_tokens": 8, "seed": 1,
            "search": SEARCH}
    via = post(fleet["router"], "/v1/chat/completions", chat)
    assert via.status_code == 200, via.text
    direct = post(other(fleet, via.headers[ROUTED]), "/v1/chat/completions", chat)
    assert direct.status_code == 200
    assert via.json()["search"]["paths_explored"] > 1 and "search" in via.json()["choices"][0]
    assert strip(via.json()) == strip(direct.json())

    streams = [
        ("/v1/completions", {"model": model, "prompt": words(5, 9), "max_tokens": 6, "seed": 2, "logprobs": 2,
                             "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": words(11, 5)}], "stream": True,
                                  "stream_options": {"include_usage": True}}),
    ]
    for path, body in streams:
        chunks, routed = events(fleet["router"], path, body)
        direct_chunks, _ = events(other(fleet, routed), path, body)
        assert chunks[-1] == "[DONE]" and len(chunks) > 3
        assert strip(chunks) == strip(direct_chunks), path
        assert len({c["id"] for c in chunks[:-1]}) == 1


def test_shared_prefix_lands_on_the_replica_that_holds_it(fleet):
    prefix = words(1, 48)  # 48 tokens: 12 blocks of 4
    before = {url: metric(url, HIT) for url in fleet["replicas"]}
    first = post(fleet["router"], "/v1/completions", {"model": fleet["model"], "prompt": prefix + " w2", "max_tokens": 2})
    assert first.status_code == 200
    holder = first.headers[ROUTED]
    for suffix in ["w3", "w4 w5", "w6", "Yes No"]:
        r = post(fleet["router"], "/v1/completions",
                 {"model": fleet["model"], "prompt": f"{prefix} {suffix}", "max_tokens": 2})
        assert r.status_code == 200 and r.headers[ROUTED] == holder
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 44
    deadline = time.monotonic() + 10  # the counters follow the runtime's stats, every 0.2 s here
    while metric(holder, HIT) < before[holder] + 4 * 44 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(holder, HIT) >= before[holder] + 4 * 44
    assert metric(other(fleet, holder), HIT) == before[other(fleet, holder)]


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) >= {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_bad_input_gives_the_same_openai_errors_through_the_router(fleet):
    model, replica = fleet["model"], next(iter(fleet["replicas"]))
    # ponder answers these itself, through the router too: the same body byte for byte.
    forwarded = [
        ("/v1/completions", {"model": model, "prompt": "w1 w2", "echo": True, "logprobs": 1, "max_tokens": 1,
                             "search": SEARCH}, "echo"),
        ("/v1/completions", {"model": model, "prompt": "w1 w2", "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "w1"}],
                                  "search": {**SEARCH, "n": 10 ** 6}}, "search.n"),
    ]
    for path, body, param in forwarded:
        via, direct = post(fleet["router"], path, body), post(replica, path, body)
        assert via.status_code == direct.status_code == 400, (via.text, direct.text)
        assert via.json() == direct.json()
        if param:
            assert error_of(via)["param"] == param
    # smg validates these before any replica sees them: the same status, OpenAI's error shape and the
    # same type and param; its own message (and for the unknown route its own type and code).
    over_cap = {"model": model, "prompt": "w1 w2", "logprobs": 21, "max_tokens": 1}
    via, direct = post(fleet["router"], "/v1/completions", over_cap), post(replica, "/v1/completions", over_cap)
    assert via.status_code == direct.status_code == 400
    assert (error_of(via)["type"], error_of(via)["param"]) == (error_of(direct)["type"], error_of(direct)["param"]) \
        == ("invalid_request_error", "logprobs")
    for method in ("GET", "POST"):
        via = httpx.request(method, fleet["router"] + "/v1/no-such-route", json={}, timeout=30)
        direct = httpx.request(method, replica + "/v1/no-such-route", json={}, timeout=30)
        assert via.status_code == direct.status_code == 404
        error_of(via), error_of(direct)


def kill_replica(proc: subprocess.Popen) -> None:
    """SIGKILL a replica's HTTP process and its runtime child, as a crash or an OOM kill would."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    proc.kill()
    proc.wait(timeout=20)
    for pid in children:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_killed_replica_s_traffic_moves_to_the_other(fleet):
    """Kill the replica that holds a shared prefix: the requests that follow, the ones the router would have
    sent there included, all succeed on the survivor (smg retries a refused connection elsewhere)."""
    prefix = words(2, 40)
    first = post(fleet["router"], "/v1/completions", {"model": fleet["model"], "prompt": prefix + " w1", "max_tokens": 2})
    victim = first.headers[ROUTED]
    survivor = other(fleet, victim)
    kill_replica(fleet["replicas"][victim])
    for i in range(6):
        # ignore_eos: the tiny model samples its end-of-text token now and then, and the count is the point
        body = {"model": fleet["model"], "prompt": f"{prefix} w{i}", "max_tokens": 3, "ignore_eos": True}
        if i % 3 == 1:
            chunks, routed = events(fleet["router"], "/v1/completions", {**body, "stream": True})
            assert chunks[-1] == "[DONE]" and routed == survivor
            assert not any("error" in c for c in chunks[:-1])
        elif i % 3 == 2:
            r = post(fleet["router"], "/v1/chat/completions",
                     {"model": fleet["model"], "messages": [{"role": "user", "content": prefix}], "max_tokens": 4,
                      "search": SEARCH})
            assert r.status_code == 200 and r.headers[ROUTED] == survivor, r.text
        else:
            r = post(fleet["router"], "/v1/completions", body)
            assert r.status_code == 200 and r.headers[ROUTED] == survivor, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
