"""Every HTTP answer is counted at the edge by route template, method and status, 4xx included."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from server.http_edge import UNMATCHED, EdgeMetrics, route_template
from server.metrics import Metrics
from tests.server.live import live_server, metric
from tests.server.test_metrics import bucket_counts, has, value

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "w1 w2 w3"}]


def small_app(metrics: Metrics) -> FastAPI:
    app = FastAPI()

    @app.get("/items/{item_id}")
    async def item(item_id: int):
        return {"id": item_id}

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    app.add_middleware(EdgeMetrics, metrics=metrics, routes=app.router.routes)
    return app


def test_route_labels_are_templates_and_unknown_paths_share_one_label():
    m = Metrics()
    with TestClient(small_app(m), raise_server_exceptions=False) as client:
        assert client.get("/items/1").status_code == 200
        assert client.get("/items/2").status_code == 200
        assert client.get("/items/x").status_code == 422
        assert client.post("/items/3").status_code == 405
        assert client.get("/nope/a").status_code == 404
        assert client.get("/nope/b").status_code == 404
        assert client.request("BREW", "/items/1").status_code == 405
        assert client.get("/boom").status_code == 500
    assert value(m, "ponder_http_requests_total", route="/items/{item_id}", method="GET", status="200") == 2
    assert value(m, "ponder_http_requests_total", route="/items/{item_id}", method="GET", status="422") == 1
    assert value(m, "ponder_http_requests_total", route="/items/{item_id}", method="POST", status="405") == 1
    assert value(m, "ponder_http_requests_total", route="/items/{item_id}", method="other", status="405") == 1
    assert value(m, "ponder_http_requests_total", route=UNMATCHED, method="GET", status="404") == 2
    assert value(m, "ponder_http_requests_total", route="/boom", method="GET", status="500") == 1
    assert not has(m, "ponder_http_requests_total", route="/nope/a", method="GET", status="404")
    assert value(m, "ponder_http_request_duration_seconds_count", route="/items/{item_id}") == 5
    assert value(m, "ponder_http_request_duration_seconds_count", route=UNMATCHED) == 2
    assert sum(v for _, v in bucket_counts(m, "ponder_http_request_duration_seconds").items()) > 0


def test_route_template_of_a_scope():
    app = small_app(Metrics())
    scope = {"type": "http", "method": "GET", "path": "/items/7", "root_path": ""}
    assert route_template(app.router.routes, scope) == "/items/{item_id}"
    assert route_template(app.router.routes, {**scope, "path": "/items/7/more"}) == UNMATCHED
    assert route_template(app.router.routes, {**scope, "method": "DELETE"}) == "/items/{item_id}"


@pytest.fixture(scope="module")
def server(tiny_llama):
    env = {"PONDER_CACHE__NUM_BLOCKS": "256", "PONDER_CACHE__BLOCK_SIZE": "4",
           "PONDER_SERVER__MAX_BODY_BYTES": "4096"}
    with live_server("--model", str(tiny_llama), "--device", "cpu", "--api-key", KEY, env=env) as (base, _):
        yield base


def count(server: str, route: str, status: str, method: str = "POST") -> float:
    return metric(server, "ponder_http_requests_total", headers=AUTH, default=0, route=route, method=method,
                  status=status)


def test_client_errors_are_counted_by_route_and_status(server):
    chat = "/v1/chat/completions"
    before = {(r, s, m): count(server, r, s, m) for r, s, m in [
        (chat, "401", "POST"), (chat, "404", "POST"), (chat, "400", "POST"), (chat, "413", "POST"),
        (chat, "200", "POST"), (UNMATCHED, "401", "GET"), ("/metrics", "401", "GET"), ("/v1/models", "200", "GET")]}
    assert httpx.post(server + chat, json={"messages": MESSAGES}).status_code == 401
    assert httpx.post(server + chat, json={"messages": MESSAGES}, headers={"Authorization": "Bearer no"}
                      ).status_code == 401
    assert httpx.post(server + chat, json={"model": "gpt-9", "messages": MESSAGES}, headers=AUTH).status_code == 404
    assert httpx.post(server + chat, json={"messages": []}, headers=AUTH).status_code == 400
    assert httpx.post(server + chat, content=b"x" * 5000, headers=AUTH).status_code == 413
    assert httpx.post(server + chat, json={"messages": MESSAGES, "max_tokens": 2}, headers=AUTH).status_code == 200
    assert httpx.get(server + "/no/such/route/42").status_code in (401, 404)
    assert httpx.get(server + "/metrics").status_code == 401
    assert httpx.get(server + "/v1/models", headers=AUTH).status_code == 200
    after = {key: count(server, *key) for key in before}
    assert {key: after[key] - before[key] for key in before} == {
        (chat, "401", "POST"): 2, (chat, "404", "POST"): 1, (chat, "400", "POST"): 1, (chat, "413", "POST"): 1,
        (chat, "200", "POST"): 1, (UNMATCHED, "401", "GET"): 0, ("/metrics", "401", "GET"): 1,
        ("/v1/models", "200", "GET"): 1}
    text = httpx.get(server + "/metrics", headers=AUTH).text
    assert "/no/such/route" not in text
    assert count(server, UNMATCHED, "404", "GET") >= 1
