"""Start `ponder serve` as a real subprocess on a free port and wait until it is healthy."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.live_server import free_port, stop  # noqa: F401 - re-exported for the tests that stop servers

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def live_server(*args: str, env: dict | None = None, wait_healthy: bool = True, timeout: float = 120.0,
                log_path: Path | None = None):
    port = free_port()
    full_env = dict(os.environ, PONDER_SERVER__STATS_INTERVAL_S="0.2", **(env or {}))
    # The server's log goes to a file: a pipe nobody reads would block a chatty server once it fills.
    log = open(log_path, "w+") if log_path is not None else tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port), *args],
                            cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"server exited early:\n{log.read()}")
            try:
                status = httpx.get(base + "/health", timeout=2).status_code
                if status == 200 or (not wait_healthy and status == 503):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become healthy")
            time.sleep(0.2)
        yield base, proc
    finally:
        stop(proc)
        log.close()


def metric(base: str, name: str, headers: dict | None = None, default: float | None = None, **labels: str) -> float:
    """A sample's value; `default` for a labelled series that has not been created yet."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", headers=headers or {}).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    if default is not None:
        return default
    raise KeyError(f"{name}{labels} not exported")
