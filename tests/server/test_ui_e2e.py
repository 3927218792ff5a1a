"""The search-tree page's routes on a live server with an API key: auth, 404s, the list, a stream
opened and dropped mid-search, and the edge metrics."""

from __future__ import annotations

import base64
import json
import threading
import time

import httpx
import pytest

from tests.server.live import live_server, metric

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASIC = {"Authorization": "Basic " + base64.b64encode(f"me:{KEY}".encode()).decode()}
MESSAGES = [{"role": "user", "content": "w1 w2 w3"}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    env = {"PONDER_SERVER__API_KEY": KEY, "PONDER_UI__MAX_TREES": "3", "PONDER_CACHE__BLOCK_SIZE": "4"}
    with live_server("--model", str(tiny_llama), "--device", "cpu", env=env) as (base, _):
        yield base


def long_search(base: str, **search) -> dict:
    """A beam search long enough to be watched while it runs (ignore_eos: every path takes every step)."""
    model = httpx.get(base + "/v1/models", headers=AUTH).json()["data"][0]["id"]
    params = dict(strategy="beam", n=8, beam_width=4, max_steps=30, max_step_tokens=6, verifier="judge")
    params.update(search)
    return {"model": model, "messages": MESSAGES, "max_tokens": 240, "temperature": 1.0, "seed": 3, "ignore_eos": True,
            "search": params}


def wait_for_running(base: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in httpx.get(base + "/ui/searches", headers=AUTH).json()["data"]:
            if entry["state"] == "running" and entry["num_nodes"] > 1:
                return entry
        time.sleep(0.05)
    raise TimeoutError("no running search showed up")


@pytest.mark.parametrize("path", ["/ui", "/ui/searches", "/ui/searches/abc", "/ui/searches/abc/events"])
def test_every_page_route_needs_the_key(server, path):
    r = httpx.get(server + path)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"].startswith("Basic ")  # so a browser asks for it
    wrong = "Basic " + base64.b64encode(b"me:nope").decode()
    assert httpx.get(server + path, headers={"Authorization": wrong}).status_code == 401


def test_the_page_and_the_list_with_the_key(server):
    page = httpx.get(server + "/ui", headers=BASIC)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<script>" in page.text and "http://" not in page.text.replace('"http://www.w3.org/2000/svg"', "")
    listing = httpx.get(server + "/ui/searches", headers=AUTH)
    assert listing.status_code == 200 and listing.json()["object"] == "list" and listing.json()["max_trees"] == 3


@pytest.mark.parametrize("path", ["/ui/searches/nope", "/ui/searches/nope/events"])
def test_an_unknown_search_is_a_404_in_the_openai_shape(server, path):
    r = httpx.get(server + path, headers=AUTH)
    assert r.status_code == 404
    assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "not_found_error",
                                  "param": "search_id", "code": "search_not_found"}}


def test_a_stream_opened_and_dropped_mid_search_leaves_the_search_to_finish(server):
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        response=httpx.post(server + "/v1/chat/completions", headers=AUTH, json=long_search(server), timeout=300)))
    worker.start()
    try:
        entry = wait_for_running(server)
        events = []
        with httpx.stream("GET", f"{server}/ui/searches/{entry['id']}/events", headers=AUTH, timeout=60) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            name = None
            for line in stream.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: ") and name:
                    events.append((name, json.loads(line[6:])))
                    if name == "delta":
                        break  # drop the stream mid-search
        assert events[0][0] == "tree" and events[1][0] == "delta"
        snapshot = events[0][1]
        assert snapshot["id"] == entry["id"] and snapshot["state"] == "running" and snapshot["strategy"] == "beam"
        assert snapshot["nodes"][0] == {"id": 0, "parent": None, "step": 0, "status": "kept", "text": "w1 w2 w3",
                                        "score": None}
        assert events[1][1]["added"] or events[1][1]["changed"]
    finally:
        worker.join(300)
    response = result["response"]
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] and choice["finish_reason"] == "length"
    tree = httpx.get(f"{server}/ui/searches/{entry['id']}", headers=AUTH).json()
    steps = response.json()["search"]["steps"]
    assert tree["state"] == "finished" and tree["steps"] == steps == 30
    # beam keeps n paths every step, and the greedy anchor runs beside them (docs/search-greedy-anchor.md)
    assert tree["num_nodes"] == len(tree["nodes"]) == 1 + (8 + 1) * steps
    selected = sorted((n for n in tree["nodes"] if n["status"] == "selected"), key=lambda n: n["step"])
    assert [n["step"] for n in selected] == list(range(steps + 1))
    assert [n["score"] for n in selected[1:]] == pytest.approx(choice["search"]["step_scores"])


def test_page_routes_are_counted_at_the_edge_by_template(server):
    httpx.get(server + "/ui/searches/a1/events", headers=AUTH)
    httpx.get(server + "/ui/searches/a2/events", headers=AUTH)
    time.sleep(0.1)
    assert metric(server, "ponder_http_requests_total", headers=AUTH, route="/ui/searches/{search_id}/events",
                  method="GET", status="404") >= 2
    assert metric(server, "ponder_http_requests_total", headers=AUTH, route="/ui", method="GET", status="401") >= 1
    with pytest.raises(KeyError):
        metric(server, "ponder_http_requests_total", headers=AUTH, route="/ui/searches/a1/events")
