"""Replicas behind a router: one `ponder serve` against two, behind the Shepherd Model Gateway (smg),
with its `cache_aware` routing against `round_robin`.

    ponder bench router [--model PATH] [--prefixes P] [--requests N] [--concurrency C] [--json PATH]

Starts two `ponder serve` replicas on 127.0.0.1 (a tiny random Llama built in a temporary directory
unless --model is given) and, for each setting, an smg router in front of them:
  - one replica (round_robin over one worker: the same router hop as the others),
  - two replicas, round_robin,
  - two replicas, cache_aware.
The workload is the one prefix caching is for: P few-shot prefixes (--prefix-words words each), and N
requests, each a prefix picked at random plus a short question of its own, sent by C concurrent clients
(text completions, greedy, --max-tokens tokens). Every setting gets prefixes of its own, so no setting
finds another's prefixes in the replicas' caches; the first request of each prefix is part of the run.
Reported per setting: requests/s, generated tokens/s, p50/p95 latency, the share of prompt tokens
found in the replicas' prefix caches (ponder_kv_prefix_hit_tokens_total over
ponder_kv_prefix_query_tokens_total, summed over the replicas), and how many requests each replica
served. Bounded: N requests per setting and --deadline seconds in all; exit status 1 when a request
fails. Needs `smg` (the `clients` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.live_server import build_tiny_model, free_port, serve, stop, wait_until
from bench.load import _round, percentile
from bench.report import columns, emit

ROUTED = "x-smg-routed-worker-id"  # smg's response header naming the replica it chose
SETTINGS = [("1 replica", 1, "round_robin"), ("2 replicas round_robin", 2, "round_robin"),
            ("2 replicas cache_aware", 2, "cache_aware")]


@dataclass(frozen=True)
class Workload:
    prefixes: int = 4
    prefix_words: int = 192
    question_words: int = 8
    requests: int = 48
    concurrency: int = 4
    max_tokens: int = 8
    seed: int = 0

    def prompts(self, setting: int) -> list[str]:
        """`requests` prompts over `prefixes` few-shot prefixes, drawn for this setting alone."""
        rng = random.Random(f"{self.seed}-{setting}")
        word = lambda: f"w{rng.randrange(60)}"  # noqa: E731
        shared = [" ".join(word() for _ in range(self.prefix_words)) for _ in range(self.prefixes)]
        return [f"{rng.choice(shared)} {' '.join(word() for _ in range(self.question_words))}"
                for _ in range(self.requests)]


@contextlib.contextmanager
def router(workers: list[str], policy: str, log_path: Path, timeout_s: float = 120.0):
    """smg on loopback in front of `workers`; yields its URL once it counts every worker healthy."""
    smg = Path(sys.executable).parent / "smg"
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(smg), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
             "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--worker-startup-check-interval", "1", "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(proc, "smg", log_path,
                   lambda: httpx.get(base + "/readiness", timeout=2).json().get("healthy_workers") == len(workers),
                   timeout_s, interval_s=0.5)
        yield base
    finally:
        stop(proc)


def prefix_tokens(replicas: list[str]) -> tuple[float, float]:
    """(hit, query) prompt tokens of the prefix caches, summed over `replicas`."""
    from prometheus_client.parser import text_string_to_metric_families

    hit = query = 0.0
    for url in replicas:
        for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
            for s in family.samples:
                hit += s.value if s.name == "ponder_kv_prefix_hit_tokens_total" else 0.0
                query += s.value if s.name == "ponder_kv_prefix_query_tokens_total" else 0.0
    return hit, query


async def drive(base: str, model: str, prompts: list[str], work: Workload, deadline_s: float) -> dict:
    queue = list(enumerate(prompts))
    latencies: list[float] = []
    tokens, errors, served = 0, [], Counter()

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            index, prompt = queue.pop(0)
            started = time.monotonic()
            try:
                r = await http.post(base + "/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": work.max_tokens, "temperature": 0})
            except httpx.HTTPError as e:
                errors.append(f"request {index}: {type(e).__name__}")
                continue
            if r.status_code != 200:
                errors.append(f"request {index}: {r.status_code} {r.text[:200]}")
                continue
            latencies.append(time.monotonic() - started)
            tokens += r.json()["usage"]["completion_tokens"]
            served[r.headers.get(ROUTED, "?")] += 1

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.wait_for(asyncio.gather(*(client(http) for _ in range(work.concurrency))), deadline_s)
    wall = time.monotonic() - started
    return {"requests": len(latencies), "errors": errors, "wall_s": round(wall, 3),
            "requests_per_s": round(len(latencies) / wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "latency_p50_s": _round(percentile(latencies, 50)), "latency_p95_s": _round(percentile(latencies, 95)),
            "served": dict(served)}


def run(replicas: list[str], model: str, work: Workload, deadline_s: float, tmp: Path) -> dict:
    rows = []
    stop_at = time.monotonic() + deadline_s
    for number, (name, count, policy) in enumerate(SETTINGS):
        workers = replicas[:count]
        with router(workers, policy, tmp / f"smg-{number}.log") as base:
            hit0, query0 = prefix_tokens(replicas)
            row = asyncio.run(drive(base, model, work.prompts(number), work, max(1.0, stop_at - time.monotonic())))
            time.sleep(0.5)  # the replicas' counters follow their runtimes' stats (every 0.2 s)
            hit1, query1 = prefix_tokens(replicas)
        served = {f"replica {replicas.index(url)}": n for url, n in sorted(row.pop("served").items())
                  if url in replicas}
        rows.append({"setting": name, "replicas": count, "policy": policy, **row, "served_by": served,
                     "prefix_hit_share": round((hit1 - hit0) / (query1 - query0), 4) if query1 > query0 else None})
    return {"workload": work.__dict__, "settings": rows, "ok": all(not r["errors"] for r in rows)}


def table(report: dict) -> str:
    w = report["workload"]
    header = ["setting", "req/s", "tok/s", "p50 s", "p95 s", "prefix hit", "served by", "errors"]
    rows = [[r["setting"], r["requests_per_s"], r["tokens_per_s"], r["latency_p50_s"], r["latency_p95_s"],
             "-" if r["prefix_hit_share"] is None else f"{100 * r['prefix_hit_share']:.0f} %",
             " / ".join(str(n) for n in r["served_by"].values()), len(r["errors"])] for r in report["settings"]]
    lines = [f"router: {w['requests']} requests over {w['prefixes']} prefixes of {w['prefix_words']} words, "
             f"{w['concurrency']} clients, max_tokens {w['max_tokens']}, model {report['model']}",
             *columns(header, rows, first_width=24)]
    lines += [f"  - {r['setting']}: {e}" for r in report["settings"] for e in r["errors"][:5]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Workload()
    parser.add_argument("--model", default=None, help="model directory (default: a tiny random Llama)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--prefixes", type=int, default=d.prefixes)
    parser.add_argument("--prefix-words", type=int, default=d.prefix_words)
    parser.add_argument("--requests", type=int, default=d.requests, help="requests per setting")
    parser.add_argument("--concurrency", type=int, default=d.concurrency)
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds for the three settings in all")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    if not (Path(sys.executable).parent / "smg").exists():
        parser.error("smg is not installed (pip install -e '.[clients]')")
    work = Workload(prefixes=args.prefixes, prefix_words=args.prefix_words, requests=args.requests,
                    concurrency=args.concurrency, max_tokens=args.max_tokens, seed=args.seed)
    env = {"PONDER_CACHE__NUM_BLOCKS": "4096", "PONDER_CACHE__BLOCK_SIZE": "16"}
    with tempfile.TemporaryDirectory(prefix="ponder-router-") as tmp, contextlib.ExitStack() as stack:
        model = Path(args.model) if args.model else build_tiny_model(Path(tmp) / "tiny-llama")
        replicas = [stack.enter_context(serve(model, Path(tmp) / f"replica-{i}.log", args.device, env))
                    for i in range(2)]
        report = run(replicas, model.name, work, args.deadline, Path(tmp))
    report["model"] = str(args.model or "tiny random llama")
    emit(report, table(report), args.json_path)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
