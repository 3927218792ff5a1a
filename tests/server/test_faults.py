"""The runtime process killed with SIGKILL mid-stream: open requests end at once with OpenAI-shaped errors,
/health dips to 503 and comes back after the restart backoff, and the next request succeeds."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.server.live import live_server, metric

MESSAGES = [{"role": "user", "content": "w1 w2 w3"}]
LONG = {"messages": MESSAGES, "max_tokens": 480, "ignore_eos": True}
SEARCH = {"strategy": "beam", "n": 4, "beam_width": 2, "max_steps": 30, "max_step_tokens": 8, "verifier": "confidence"}


def children(pid: int) -> list[int]:
    """Child processes of `pid`, from the parent field of every /proc/<pid>/stat."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited while we looked
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
        if int(text.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def runtime_pid(server_pid: int) -> int:
    for pid in children(server_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"runtime.process" in argv:
            return pid
    raise LookupError(f"process {server_pid} has no runtime child")


@dataclass
class Ended:
    status: int
    events: list[str] = field(default_factory=list)  # SSE payloads of a stream
    body: dict | None = None  # the JSON body of a non-streaming response
    ended_at: float = 0.0


@dataclass
class Kill:
    """Everything observed around one SIGKILL of the runtime."""

    old_pid: int
    new_pid: int = 0
    killed_at: float = 0.0
    open_requests: dict[str, Ended] = field(default_factory=dict)
    health: list[tuple[float, int, str | None]] = field(default_factory=list)  # (time, status, error code)
    during_outage: Ended | None = None
    restarts_before: float = 0.0
    restarts_after: float = 0.0


async def _stream(http: httpx.AsyncClient, url: str, body: dict, flowing: asyncio.Event, min_events: int) -> Ended:
    async with http.stream("POST", url, json={**body, "stream": True}) as r:
        ended = Ended(r.status_code)
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                ended.events.append(line[len("data: "):])
                if len(ended.events) >= min_events:
                    flowing.set()
    ended.ended_at = time.monotonic()
    return ended


async def _post(http: httpx.AsyncClient, url: str, body: dict) -> Ended:
    r = await http.post(url, json=body)
    return Ended(r.status_code, body=r.json(), ended_at=time.monotonic())


async def _kill_mid_stream(base: str, server_pid: int) -> Kill:
    url = base + "/v1/chat/completions"
    kill = Kill(old_pid=runtime_pid(server_pid), restarts_before=metric(base, "ponder_runtime_restarts_total"))
    async with httpx.AsyncClient(timeout=60) as http:
        flowing = {name: asyncio.Event() for name in ("plain", "n2", "search")}
        tasks = {
            "plain": asyncio.create_task(_stream(http, url, LONG, flowing["plain"], 4)),
            "n2": asyncio.create_task(_stream(http, url, {**LONG, "n": 2}, flowing["n2"], 6)),
            # The role chunk comes first; the answer only once the search is over.
            "search": asyncio.create_task(_stream(http, url, {**LONG, "search": SEARCH}, flowing["search"], 1)),
            "non_streaming": asyncio.create_task(_post(http, url, LONG)),
        }
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in flowing.values())), 30)
        deadline = time.monotonic() + 10
        while (metric(base, "ponder_http_requests_in_flight", endpoint="chat") < 4
               or metric(base, "ponder_requests_running") < 4):  # the non-streaming one is running too
            assert time.monotonic() < deadline, "the requests did not all reach the runtime"
            await asyncio.sleep(0.05)
        assert not any(t.done() for t in tasks.values()), "a request finished before the kill"

        os.kill(kill.old_pid, signal.SIGKILL)
        kill.killed_at = time.monotonic()
        done, _ = await asyncio.wait(tasks.values(), timeout=10)
        kill.open_requests = {name: t.result() for name, t in tasks.items() if t in done}

        while True:  # /health until it is 200 again
            r = await http.get(base + "/health")
            code = r.json()["error"]["code"] if r.status_code != 200 else None
            kill.health.append((time.monotonic() - kill.killed_at, r.status_code, code))
            if r.status_code == 200:
                break
            if kill.during_outage is None:
                kill.during_outage = await _post(http, url, {"messages": MESSAGES, "max_tokens": 2})
            assert time.monotonic() - kill.killed_at < 90, "the runtime did not come back"
            await asyncio.sleep(0.05)
    kill.new_pid = runtime_pid(server_pid)
    kill.restarts_after = metric(base, "ponder_runtime_restarts_total")
    return kill


@pytest.fixture(scope="module")
def server(tiny_llama):
    env = {"PONDER_CACHE__NUM_BLOCKS": "1024", "PONDER_CACHE__BLOCK_SIZE": "4", "PONDER_SERVER__LOG_LEVEL": "WARNING"}
    with live_server("--model", str(tiny_llama), "--device", "cpu", env=env) as (base, proc):
        yield base, proc.pid


@pytest.fixture(scope="module")
def kill(server) -> Kill:
    base, pid = server
    return asyncio.run(_kill_mid_stream(base, pid))


def _is_openai_error(error: dict) -> bool:
    return set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)


@pytest.mark.parametrize("name", ["plain", "n2", "search"])
def test_open_streams_end_with_an_error_event_then_done_within_5_s(kill, name):
    ended = kill.open_requests.get(name)
    assert ended is not None, f"the {name} stream was still open 10 s after the kill"
    assert ended.status == 200 and ended.ended_at - kill.killed_at < 5.0
    assert ended.events[-1] == "[DONE]"
    error = json.loads(ended.events[-2])
    assert list(error) == ["error"] and _is_openai_error(error["error"])
    assert error["error"]["type"] == "server_error" and error["error"]["code"] == "runtime_unavailable"
    chunks = [json.loads(e) for e in ended.events[:-2]]
    assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert not any(choice["finish_reason"] for c in chunks for choice in c["choices"]), "it had finished"


def test_an_open_non_streaming_request_gets_a_503_within_5_s(kill):
    ended = kill.open_requests.get("non_streaming")
    assert ended is not None, "the non-streaming request was still open 10 s after the kill"
    assert ended.status == 503 and ended.ended_at - kill.killed_at < 5.0
    assert list(ended.body) == ["error"] and _is_openai_error(ended.body["error"])
    assert ended.body["error"]["code"] == "runtime_unavailable"


def test_health_is_503_until_the_restart_after_its_backoff(kill):
    statuses = [status for _, status, _ in kill.health]
    assert statuses[0] == 503 and statuses[-1] == 200 and 200 not in statuses[:-1]
    codes = [code for _, _, code in kill.health[:-1]]
    assert codes[0] == "runtime_dead" and set(codes) <= {"runtime_dead", "runtime_loading"}
    # The first restart waits one second of backoff before it starts loading again.
    first_loading = next(t for t, _, code in kill.health if code != "runtime_dead")
    assert first_loading >= 0.9


def test_a_request_during_the_outage_is_an_openai_503(kill):
    assert kill.during_outage is not None
    assert kill.during_outage.status == 503 and _is_openai_error(kill.during_outage.body["error"])


def test_a_new_runtime_process_replaces_the_killed_one(kill):
    assert kill.new_pid != kill.old_pid
    assert not Path(f"/proc/{kill.old_pid}").exists()  # reaped, not a zombie
    assert kill.restarts_after == kill.restarts_before + 1


def test_the_next_requests_succeed(server, kill):
    base, _ = server
    r = httpx.post(base + "/v1/chat/completions", json={**LONG, "max_tokens": 5}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 5
    with httpx.stream("POST", base + "/v1/chat/completions", timeout=30,
                      json={"messages": MESSAGES, "max_tokens": 12, "stream": True, "search": SEARCH}) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert any(choice["finish_reason"] for e in events[:-1] for choice in json.loads(e)["choices"])
    assert metric(base, "ponder_runtime_up") == 1
