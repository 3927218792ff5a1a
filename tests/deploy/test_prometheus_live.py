"""A real Prometheus scrapes a live ponder through a copy of deploy/prometheus.yml; after a mix of
answered, failed and rejected requests, every query of the Grafana dashboard returns data.

Needs the `prometheus` binary and `promtool` (Debian: `apt-get install -y prometheus`)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.test_deploy_files import DEPLOY, all_panels, dashboard, template_variables
from tests.server.live import free_port, live_server, stop

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None,
                                reason="prometheus/promtool not found (Debian: apt-get install -y prometheus)")

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "w1 w2 w3"}]
RATE_INTERVAL = "1m"  # what Grafana's $__rate_interval stands for here: every request lies inside it


def test_promtool_accepts_the_shipped_config():
    # --syntax-only: the key file it names is the compose secret, which exists only in the container.
    result = subprocess.run([PROMTOOL, "check", "config", "--syntax-only", str(DEPLOY / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def loopback_config(target: str, directory: Path) -> Path:
    """deploy/prometheus.yml with its ponder job pointed at `target`, scraping every second with the
    key read from a file here rather than the compose secret."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "ponder"]
    job["static_configs"] = [{"targets": [target]}]
    job["scrape_interval"] = "1s"
    job["scrape_timeout"] = "1s"
    key_file = directory / "ponder_api_key"
    key_file.write_text(KEY)
    assert job["authorization"]["credentials_file"] == "/run/secrets/ponder_api_key"
    job["authorization"]["credentials_file"] = str(key_file)
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([PROMTOOL, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return path


@pytest.fixture(scope="module")
def ponder(tiny_llama):
    env = {"PONDER_CACHE__NUM_BLOCKS": "256", "PONDER_CACHE__BLOCK_SIZE": "4", "PONDER_SERVER__API_KEY": KEY,
           "PONDER_SERVER__MAX_BODY_BYTES": "4096"}  # /metrics needs the key, as in deploy/compose.yaml
    with live_server("--model", str(tiny_llama), "--device", "cpu", env=env) as (base, _):
        yield base


@pytest.fixture(scope="module")
def prometheus(ponder, tmp_path_factory):
    directory = tmp_path_factory.mktemp("prometheus")
    target = ponder.removeprefix("http://")
    port = free_port()
    log = (directory / "log").open("w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={loopback_config(target, directory)}",
                             f"--storage.tsdb.path={directory / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (directory / "log").read_text()
            try:
                if httpx.get(base + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        yield base, target
    finally:
        stop(proc)
        log.close()


def send_traffic(ponder: str) -> None:
    """Answered plain, streamed and search requests, and the client errors a dashboard must show."""
    post = lambda body, **kw: httpx.post(ponder + CHAT, json=body, timeout=120, **kw)  # noqa: E731
    assert post({"messages": MESSAGES, "max_tokens": 4}, headers=AUTH).status_code == 200
    with httpx.stream("POST", ponder + CHAT, headers=AUTH, timeout=60,
                      json={"messages": MESSAGES, "max_tokens": 6, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200 and r.read().endswith(b"data: [DONE]\n\n")
    search = {"strategy": "beam", "n": 4, "beam_width": 2, "max_steps": 2, "max_step_tokens": 4, "verifier": "judge"}
    assert post({"messages": MESSAGES, "max_tokens": 8, "seed": 1, "search": search}, headers=AUTH).status_code == 200
    assert httpx.post(ponder + "/v1/completions", json={"prompt": "w1 w2", "max_tokens": 3}, headers=AUTH,
                      timeout=60).status_code == 200
    assert post({"messages": MESSAGES}).status_code == 401
    assert post({"model": "gpt-9", "messages": MESSAGES}, headers=AUTH).status_code == 404
    assert post({"messages": []}, headers=AUTH).status_code == 400
    assert httpx.post(ponder + CHAT, content=b"x" * 5000, headers=AUTH).status_code == 413


def query(prometheus: str, expr: str) -> list[dict]:
    body = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def wait_for_scrape_of(ponder: str, prometheus: str, instance: str) -> None:
    """Until Prometheus holds the count of chat requests the server reports now."""
    from tests.server.live import metric

    expected = sum(metric(ponder, "ponder_http_requests_total", headers=AUTH, default=0, route=CHAT, method="POST",
                          status=s)
                   for s in ("200", "400", "401", "404", "413"))
    expr = f'sum(ponder_http_requests_total{{instance="{instance}",route="{CHAT}"}})'
    deadline = time.monotonic() + 30
    while True:
        result = query(prometheus, expr)
        if result and float(result[0]["value"][1]) == expected:
            return
        assert time.monotonic() < deadline, f"prometheus never saw {expected} chat requests: {result}"
        time.sleep(0.25)


def substitute(expr: str, instance: str) -> str:
    return (expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__range", "5m")
            .replace("$instance", instance).replace("$model", ".*"))


def test_every_dashboard_query_returns_data(ponder, prometheus):
    prometheus_base, instance = prometheus
    # Two rounds: a labelled series a scrape has not seen yet only starts its rate at its second sample.
    send_traffic(ponder)
    wait_for_scrape_of(ponder, prometheus_base, instance)
    send_traffic(ponder)
    wait_for_scrape_of(ponder, prometheus_base, instance)

    variables = template_variables()
    model = httpx.get(ponder + "/v1/models", headers=AUTH).json()["data"][0]["id"]
    match = variables["instance"]["definition"].removeprefix("label_values(").removesuffix(", instance)")
    instances = httpx.get(prometheus_base + "/api/v1/label/instance/values",
                          params={"match[]": match.replace("$model", model)}).json()["data"]
    assert instances == [instance]

    panels = [p for p in all_panels(dashboard()["panels"]) if p["type"] != "row"]
    checked = 0
    for panel in panels:
        for target in panel["targets"]:
            result = query(prometheus_base, substitute(target["expr"], instance))
            # A quantile by route is NaN for a route idle over the window; at least one must be a number.
            assert any(sample["value"][1] != "NaN" for sample in result), (panel["title"], target["expr"], result)
            checked += 1
    assert checked == sum(len(p["targets"]) for p in panels) >= 30

    (error_share,) = [p for p in panels if p["title"] == "Error share"]
    (server_errors, client_errors) = (float(query(prometheus_base, substitute(t["expr"], instance))[0]["value"][1])
                                      for t in error_share["targets"])
    assert server_errors == 0 and client_errors > 0.3  # 4 of 8 API requests per round were 4xx
    by_route = query(prometheus_base, substitute(
        'sum by (route, status) (rate(ponder_http_requests_total{instance=~"$instance"}[1m]))', instance))
    assert {("/v1/chat/completions", s) for s in ("200", "400", "401", "404", "413")} <= {
        (s["metric"]["route"], s["metric"]["status"]) for s in by_route if float(s["value"][1]) > 0}


def test_the_restart_annotation_is_a_valid_query(prometheus):
    prometheus_base, instance = prometheus
    for annotation in dashboard()["annotations"]["list"]:
        if "expr" in annotation:
            assert query(prometheus_base, substitute(annotation["expr"], instance)) == []  # no restart happened
