"""How long `ponder serve` takes until GET /health answers 200: a cold start (empty start-up cache,
so the kernels are compiled, the tokenizer converted and the GGUF dequantized and packed) and warm
starts (the cache the cold start filled), each split into phases by when its log lines appeared;
and llama.cpp's `llama-server` on the same GGUF where one is installed.

    ponder bench startup [--warm-runs 2] [--cache-dir DIR] [--json out.json]

Each start gets `XDG_CACHE_HOME` pointed at one scratch directory (or `--cache-dir`), so the user's
own cache is neither read nor emptied. The start-up settings check (`python -m runtime.preflight`;
`ponder serve` runs it first thing in the runtime process, which it starts before importing the HTTP
side and binding its port) is also timed alone, as a process of its own. Timings include whatever else the machine
runs: the load average is reported with them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.live_server import free_port, stop
from bench.report import columns, emit

# Log lines marking the end of each phase, in order; a phase runs from the previous mark to its own.
PHASES = (
    # The runtime process imports and checks the settings while the HTTP side imports; the port is
    # bound once the check passed.
    ("runtime imports and settings check; server start", "Uvicorn running on"),
    ("runtime imports, the rest", "loading tokenizer from"),
    ("tokenizer", "tokenizer loaded in"),
    ("CPU kernels", "ponder CPU kernels"),
    ("model and int4 layers", "model loaded in"),
    ("KV pool and engine", "runtime ready"),
)


def health_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def timed_start(command: list[str], port: int, env: dict, timeout: float) -> dict:
    """Start `command`, poll /health until 200, stop it; each output line with the second it appeared."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                               errors="replace")
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in process.stdout:
            lines.append((time.perf_counter() - start, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ready = None
    try:
        while time.perf_counter() - start < timeout and process.poll() is None:
            if health_ok(port):
                ready = time.perf_counter() - start
                break
            time.sleep(0.1)
    finally:
        stop(process)
        reader.join(timeout=5)
    return {"ready_s": ready, "lines": lines, "exit": process.returncode}


def phases(lines: list[tuple[float, str]], ready_s: float | None) -> dict[str, float]:
    """Seconds of each phase of PHASES found in the log, and the last stretch until /health said 200."""
    found, last = {}, 0.0
    for name, mark in PHASES:
        at = next((t for t, line in lines if mark in line and t >= last), None)
        if at is None:
            continue
        found[name] = round(at - last, 2)
        last = at
    if ready_s is not None:
        found["until /health is 200"] = round(ready_s - last, 2)
    return found


def ponder_start(cache: Path, warm: bool, timeout: float) -> dict:
    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PONDER_SERVER__LOG_LEVEL": "INFO"}
    run = timed_start([sys.executable, "-m", "server.cli", "serve", "--port", str(port)], port, env, timeout)
    log_tail = [line for _, line in run["lines"][-5:]]
    return {"start": "warm" if warm else "cold", "ready_s": None if run["ready_s"] is None else round(run["ready_s"], 2),
            "phases": phases(run["lines"], run["ready_s"]), **({} if run["ready_s"] else {"log_tail": log_tail})}


def preflight_seconds(cache: Path) -> float:
    """`python -m runtime.preflight` on the default settings, alone, as `ponder serve` runs it."""
    from runtime.wire.client import runtime_environment
    from runtime.wire.protocol import encode
    from server.config import Settings

    options = encode(Settings.load(None).runtime_options())
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "runtime.preflight"], input=options, capture_output=True, check=True,
                   env={**runtime_environment(), "XDG_CACHE_HOME": str(cache)})
    return round(time.perf_counter() - start, 2)


def llama_server_start(binary: str | None, timeout: float) -> dict:
    if binary is None:
        return {"skipped": "no llama-server on PATH (llama.cpp's server; pass --llama-server PATH)"}
    from runtime.model.loader import default_model_path

    port = free_port()
    run = timed_start([binary, "-m", str(default_model_path()), "--port", str(port), "--host", "127.0.0.1"],
                      port, dict(os.environ), timeout)
    return {"ready_s": None if run["ready_s"] is None else round(run["ready_s"], 2)}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def table(results: dict) -> str:
    starts = results["starts"]
    names = [name for name, _ in PHASES] + ["until /health is 200"]
    rows = [[name] + [start["phases"].get(name, "-") for start in starts] for name in names]
    rows.append(["ready (s)"] + [start["ready_s"] if start["ready_s"] is not None else "timeout" for start in starts])
    rows.append(["load average"] + [" ".join(map(str, start["load_average"])) for start in starts])
    lines = [f"ponder serve on the embedded model ({os.cpu_count()} CPUs), seconds per phase:"]
    lines += columns(["phase"] + [start["start"] for start in starts], rows, first_width=28)
    lines.append(f"preflight alone (inside the first phase): {results['preflight_s']} s")
    llama = results["llama_server"]
    lines.append("llama-server: " + (f"ready in {llama['ready_s']} s" if "ready_s" in llama else
                                     f"skipped ({llama['skipped']})"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm-runs", type=int, default=2, help="starts after the cold one (default 2)")
    parser.add_argument("--cache-dir", help="XDG_CACHE_HOME for the starts (default: a scratch directory, "
                                            "emptied first: the first start is cold)")
    parser.add_argument("--no-cold", action="store_true", help="keep --cache-dir's contents: every start is warm")
    parser.add_argument("--llama-server", default=shutil.which("llama-server"), help="llama.cpp's server binary")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one start may take")
    parser.add_argument("--json", help="save the results here")
    args = parser.parse_args(argv)
    scratch = None
    if args.cache_dir:
        cache = Path(args.cache_dir)
    else:
        scratch = tempfile.TemporaryDirectory(prefix="ponder-startup-")
        cache = Path(scratch.name)
    if not args.no_cold:
        shutil.rmtree(cache / "ponder", ignore_errors=True)
    starts = []
    for i in range(args.warm_runs + (0 if args.no_cold else 1)):
        before = load_average()
        start = ponder_start(cache, warm=args.no_cold or i > 0, timeout=args.timeout)
        start["load_average"] = before
        starts.append(start)
    results = {"benchmark": "startup", "cpus": os.cpu_count(), "starts": starts,
               "preflight_s": preflight_seconds(cache), "llama_server": llama_server_start(args.llama_server, args.timeout),
               "load_average_end": load_average()}
    if scratch is not None:
        scratch.cleanup()
    line = {"benchmark": "startup", **{f"{s['start']}_{i}_ready_s": s["ready_s"] for i, s in enumerate(starts)}}
    emit(results, table(results), args.json, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
