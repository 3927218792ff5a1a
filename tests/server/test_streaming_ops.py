"""Long searches are never silent: SSE keep-alive comments, progress, and a timeout that answers with
the best path so far. Probes stay out of the access log."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from server.http_edge import ProbeAccessFilter, quiet_probe_access_log
from tests.server.live import live_server

MESSAGES = [{"role": "user", "content": "w1 w2 w3"}]
CHAT = "/v1/chat/completions"
KEEPALIVE_S = 0.3
CAP_S = 8
# A search far longer than the cap on the tiny model: 64 paths of up to 400 tokens, 100 steps (32
# paths reach about 86 steps in the 8 s of the cap).
LONG = {"strategy": "beam", "n": 64, "beam_width": 8, "max_steps": 100, "max_step_tokens": 4, "verifier": "judge"}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("log") / "server.log"
    env = {"PONDER_CACHE__NUM_BLOCKS": "8192", "PONDER_CACHE__BLOCK_SIZE": "4",
           "PONDER_SERVER__SSE_KEEPALIVE_S": str(KEEPALIVE_S), "PONDER_SEARCH__MAX_TIMEOUT_S": str(CAP_S),
           # 8 sequences at a time: the long search's 64 paths outlast the cap on a fast, quiet CPU too
           "PONDER_SCHEDULER__MAX_NUM_SEQS": "8"}
    with live_server("--model", str(tiny_llama), "--device", "cpu", env=env, log_path=log_path) as (base, _):
        yield base, log_path


def body(**extra) -> dict:
    return {"messages": MESSAGES, "max_tokens": 400, "temperature": 1.0, "seed": 2, "ignore_eos": True, **extra}


def step_seconds(summary: dict) -> float:
    """The seconds one search step took in this very search (generation and verification over its steps):
    the unit the deadline's overrun is counted in, so it grows with the machine's load."""
    return (summary["seconds_generating"] + summary["seconds_verifying"]) / max(1, summary["steps"])


def timed_lines(base: str, payload: dict) -> tuple[float, list[tuple[float, str]]]:
    """(seconds until the response headers, [(seconds since the request, line)]) of a streamed request."""
    start = time.monotonic()
    lines = []
    with httpx.stream("POST", base + CHAT, json=payload, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        headers_at = time.monotonic() - start
        for line in r.iter_lines():
            if line:
                lines.append((time.monotonic() - start, line))
    return headers_at, lines


def test_a_long_streamed_search_is_never_silent(server):
    base, _ = server
    headers_at, lines = timed_lines(base, body(stream=True, search={**LONG, "timeout_s": 2}))
    times = [t for t, _ in lines]
    texts = [line for _, line in lines]
    assert headers_at < 2 and times[0] < 2 and texts[0] == ": search started"
    gaps = [b - a for a, b in zip([headers_at] + times, times)]
    assert max(gaps) < KEEPALIVE_S + 1.0, gaps
    assert ": keep-alive" in texts
    assert any(t.startswith(": search step ") and t.endswith(" live paths") for t in texts)
    data = [t for t in texts if not t.startswith(":")]
    assert all(t.startswith("data: ") for t in data) and data[-1] == "data: [DONE]"
    chunks = [json.loads(t[len("data: "):]) for t in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert not any("search" in c and "step" in c["search"] for c in chunks)  # events only when asked for
    finish = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    # Cut short by the deadline: "length"; a path that had ended by itself before it keeps "stop".
    assert len(finish) == 1 and finish[0] in ("length", "stop")
    assert chunks[-1]["search"]["timed_out"] is True


def test_search_events_replace_the_progress_comments_when_asked_for(server):
    base, _ = server
    # One batch of paths for three steps: ended by its steps on a busy machine too, never by the clock.
    search = {**LONG, "n": 8, "beam_width": 4, "max_steps": 3, "verifier": "confidence", "timeout_s": CAP_S}
    _, lines = timed_lines(base, body(stream=True, stream_options={"include_search_events": True}, search=search))
    texts = [line for _, line in lines]
    assert not any(t.startswith(": search step") for t in texts)
    events = [json.loads(t[6:])["search"] for t in texts if t.startswith("data: {") and '"step"' in t]
    assert [e["step"] for e in events] == [1, 2, 3]


def test_a_search_past_its_timeout_returns_the_best_answer_so_far(server):
    base, _ = server
    start = time.monotonic()
    r = httpx.post(base + CHAT, json=body(search={**LONG, "timeout_s": 1}), timeout=60)
    elapsed = time.monotonic() - start
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["search"]["timed_out"] is True and answer["search"]["steps"] < LONG["max_steps"]
    assert answer["choices"][0]["finish_reason"] in ("length", "stop")  # "stop": the path ended by itself
    assert answer["choices"][0]["message"]["content"]
    # The deadline is checked at every engine step, so the answer comes at most a step or two past it
    # (counted in this search's own step time), plus the process hop.
    assert 1 <= elapsed < 1 + 5 + 2 * step_seconds(answer["search"])


def test_the_cap_is_the_timeout_of_a_search_that_sets_none(server):
    base, _ = server
    start = time.monotonic()
    answer = httpx.post(base + CHAT, json=body(search=LONG), timeout=60).json()
    assert answer["search"]["timed_out"] is True
    assert CAP_S <= time.monotonic() - start < CAP_S + 5 + 2 * step_seconds(answer["search"])


def test_a_short_search_does_not_time_out(server):
    """Counted in steps, not seconds: one batch of paths (as many as run at once) for two steps of four
    tokens is about ten engine steps on the tiny model, a small fraction of the cap even on a machine
    many times slower than a quiet one, so it ends by its step count, never by the clock."""
    base, _ = server
    search = {**LONG, "n": 8, "beam_width": 4, "max_steps": 2, "verifier": "confidence", "timeout_s": CAP_S}
    answer = httpx.post(base + CHAT, json=body(max_tokens=8, search=search), timeout=60).json()
    assert answer["search"]["timed_out"] is False and answer["search"]["steps"] == 2


@pytest.mark.parametrize("timeout_s", [0.5, 0, -1, CAP_S + 0.5, 10**6])
def test_a_timeout_under_one_second_or_over_the_cap_is_a_400_naming_the_field(server, timeout_s):
    base, _ = server
    r = httpx.post(base + CHAT, json=body(search={**LONG, "timeout_s": timeout_s}), timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "search.timeout_s" and "timeout_s" in error["message"]


def test_probes_stay_out_of_the_access_log(server):
    base, log_path = server
    for path in ("/health", "/metrics", "/health?x=1", "/v1/models"):
        assert httpx.get(base + path).status_code == 200
    time.sleep(0.2)
    log = log_path.read_text()
    assert '"GET /v1/models HTTP/1.1" 200' in log
    assert "GET /health" not in log and "GET /metrics" not in log


def access_record(path: str) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                             ("127.0.0.1:5", "GET", path, "1.1", 200), None)


def test_the_probe_filter_and_the_setting_that_turns_it_off():
    probe_filter = ProbeAccessFilter()
    assert not probe_filter.filter(access_record("/health"))
    assert not probe_filter.filter(access_record("/metrics?name[]=x"))
    assert probe_filter.filter(access_record("/v1/models"))
    assert probe_filter.filter(access_record("/healthz"))
    logger = logging.getLogger("uvicorn.access")
    with quiet_probe_access_log(True):
        assert any(isinstance(f, ProbeAccessFilter) for f in logger.filters)
    assert not any(isinstance(f, ProbeAccessFilter) for f in logger.filters)
    with quiet_probe_access_log(False):
        assert not any(isinstance(f, ProbeAccessFilter) for f in logger.filters)
