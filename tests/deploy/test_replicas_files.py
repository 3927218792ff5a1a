"""deploy/compose.replicas.yaml and deploy/prometheus.replicas.yml agree with each other and with ponder:
one GPU of its own per replica, the router in front of every replica with cache_aware routing and the
API key, Prometheus scraping every replica (with the key) and the router, only the router's API port
open to the network."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.replicas.yaml").read_text())


def replicas(spec: dict) -> dict[str, dict]:
    return {name: s for name, s in spec["services"].items() if re.fullmatch(r"ponder-\d+", name)}


def option(command: list[str], flag: str) -> list[str]:
    """The values after `flag` up to the next flag."""
    start = command.index(flag) + 1
    values = []
    for arg in command[start:]:
        if arg.startswith("--"):
            break
        values.append(arg)
    return values


def test_every_replica_has_a_gpu_of_its_own_and_no_published_port():
    spec = compose()
    reps = replicas(spec)
    assert len(reps) >= 2
    devices = []
    for service in reps.values():
        assert service["command"][:3] == ["serve", "--host", "0.0.0.0"]
        assert "ports" not in service
        assert service["environment"]["PONDER_SERVER__API_KEY"].startswith("${PONDER_API_KEY:?")
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and "count" not in device
        devices += device["device_ids"]
        kv = [v for v in service["volumes"] if v.endswith(":/var/lib/ponder/kv")]
        assert len(kv) == 1
    assert len(devices) == len(set(devices)) == len(reps)
    kv_volumes = [v.split(":")[0] for s in reps.values() for v in s["volumes"] if v.endswith(":/var/lib/ponder/kv")]
    assert len(set(kv_volumes)) == len(reps), "each replica spills its KV to a volume of its own"
    assert set(kv_volumes) <= set(spec["volumes"])


def test_the_router_fronts_every_replica_with_cache_aware_routing_and_the_key():
    spec = compose()
    router = spec["services"]["router"]
    command = router["command"]
    assert command[0] == "launch"
    assert option(command, "--worker-urls") == [f"http://{name}:8000" for name in replicas(spec)]
    assert option(command, "--policy") == ["cache_aware"]
    assert option(command, "--api-key") == ["${PONDER_API_KEY:?set PONDER_API_KEY to the key clients must send}"]
    assert router["ports"] == ["8000:8000"]
    assert "smg==" in router["build"]["dockerfile_inline"]
    # Everything else answers on the host's loopback only.
    for name, service in spec["services"].items():
        if name != "router":
            assert all(str(p).startswith("127.0.0.1:") for p in service.get("ports", [])), name


def test_prometheus_scrapes_every_replica_with_the_key_and_the_router():
    spec = compose()
    prometheus = spec["services"]["prometheus"]
    assert "./prometheus.replicas.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert prometheus["secrets"] == ["ponder_api_key"]
    config = yaml.safe_load((DEPLOY / "prometheus.replicas.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    [static] = jobs["ponder"]["static_configs"]
    assert static["targets"] == [f"{name}:8000" for name in replicas(spec)]
    assert jobs["ponder"]["authorization"]["credentials_file"] == "/run/secrets/ponder_api_key"
    router_port = option(spec["services"]["router"]["command"], "--prometheus-port")
    assert jobs["smg"]["static_configs"][0]["targets"] == [f"router:{router_port[0]}"]


def test_every_host_path_it_mounts_exists():
    for service in compose()["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), volume


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian's prometheus)")
def test_promtool_accepts_the_prometheus_config(tmp_path):
    key = tmp_path / "key"
    key.write_text("secret")
    config = tmp_path / "prometheus.yml"
    config.write_text((DEPLOY / "prometheus.replicas.yml").read_text().replace("/run/secrets/ponder_api_key", str(key)))
    done = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
