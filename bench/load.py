"""Load: many concurrent streaming clients against a live `ponder serve`.

    ponder bench load [--model PATH] [--clients N] [--requests-per-client K] [--json PATH]

Starts `ponder serve` on 127.0.0.1 (on a tiny random Llama built in a temporary directory unless
--model is given, so the numbers measure the server rather than the model), then runs N clients at
once, each sending K streamed chat requests one after another: plain ones and tree-search ones, some
of them dropped by the client on purpose. It checks that
  - no request fails: every response is a 200 stream without an error event;
  - nothing is lost or truncated: every stream not dropped on purpose gives each choice a finish
    reason and ends with `data: [DONE]`; a plain stream reports exactly `max_tokens` completion tokens;
  - afterwards the server is idle: `ponder_kv_blocks{state="used"}` is 0 in every tier, the runtime
    runs and queues nothing, no HTTP request is in flight and none was answered with a 5xx;
and reports p50/p99 time to first token and latency, requests/s and tokens/s. Exit status 1 when a
check fails. The run is bounded: K requests per client and --deadline seconds in all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.live_server import build_tiny_model, serve
from bench.report import emit

SEARCH = {"strategy": "beam", "n": 4, "beam_width": 2, "max_steps": 3, "max_step_tokens": 8, "verifier": "confidence"}
# Every prompt starts the same way so that concurrent requests also share prefix-cache blocks.
SHARED_PREFIX = "w1 w2 w3 w4 w5 w6 w7 w8"


@dataclass(frozen=True)
class LoadPlan:
    clients: int = 64
    requests_per_client: int = 2
    max_tokens: int = 32
    search_every: int = 3  # request i is a search request when i % search_every == 0
    cancel_every: int = 5  # request i is dropped by the client when i % cancel_every == 1
    cancel_after_chunks: int = 3  # plain requests; search requests are dropped after the first chunk, mid-search
    request_timeout_s: float = 120.0
    deadline_s: float = 300.0
    seed: int = 0

    @property
    def num_requests(self) -> int:
        return self.clients * self.requests_per_client


@dataclass
class Outcome:
    index: int
    kind: str  # "plain" | "search"
    drop_planned: bool
    status: int | None = None
    error: str | None = None
    dropped: bool = False  # the client closed the stream before [DONE]
    done: bool = False  # `data: [DONE]` was the last event
    finish_reasons: dict[int, str] = field(default_factory=dict)
    completion_tokens: int | None = None
    ttft_s: float | None = None
    latency_s: float | None = None

    @property
    def completed(self) -> bool:
        return self.error is None and not self.dropped

    def problem(self, max_tokens: int) -> str | None:
        """Why this outcome breaks an invariant, or None."""
        if self.error is not None:
            return f"request {self.index} ({self.kind}): {self.error}"
        if self.dropped:
            return None
        if not self.done:
            return f"request {self.index} ({self.kind}): the stream ended without data: [DONE]"
        if set(self.finish_reasons) != {0}:
            return f"request {self.index} ({self.kind}): finish reasons {self.finish_reasons}, expected one for choice 0"
        if self.completion_tokens is None:
            return f"request {self.index} ({self.kind}): no usage chunk"
        if self.kind == "plain" and (self.completion_tokens != max_tokens or self.finish_reasons[0] != "length"):
            return (f"request {self.index} (plain): {self.completion_tokens} tokens, finish "
                    f"{self.finish_reasons[0]!r}; expected {max_tokens} and 'length'")
        return None


# -- driving --------------------------------------------------------------------------------------

def _body(plan: LoadPlan, index: int, rng: random.Random) -> dict:
    tail = " ".join(f"w{rng.randrange(60)}" for _ in range(rng.randint(2, 16)))
    body = {"messages": [{"role": "user", "content": f"{SHARED_PREFIX} {tail}"}], "max_tokens": plan.max_tokens,
            "temperature": 1.0, "seed": index, "stream": True, "stream_options": {"include_usage": True}}
    if index % plan.search_every == 0:
        body["search"] = SEARCH
    else:
        body["ignore_eos"] = True  # every plain stream runs to max_tokens, so truncation is visible
    return body


async def _one(http: httpx.AsyncClient, base: str, plan: LoadPlan, index: int, rng: random.Random) -> Outcome:
    body = _body(plan, index, rng)
    kind = "search" if "search" in body else "plain"
    out = Outcome(index, kind, drop_planned=index % plan.cancel_every == 1)
    drop_after = (1 if kind == "search" else plan.cancel_after_chunks) if out.drop_planned else None
    started = time.perf_counter()
    response_id = None
    chunks = 0
    try:
        async with http.stream("POST", base + "/v1/chat/completions", json=body) as response:
            out.status = response.status_code
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return out
            async for line in response.aiter_lines():
                if not line or line.startswith(":"):
                    continue  # SSE comments: keep-alive and search progress
                if out.done:
                    out.error = f"data after [DONE]: {line[:200]!r}"
                    return out
                if not line.startswith("data: "):
                    out.error = f"not an SSE data line: {line[:200]!r}"
                    return out
                data = line[len("data: "):]
                if data == "[DONE]":
                    out.done = True
                    out.latency_s = time.perf_counter() - started
                    continue
                event = json.loads(data)
                if "error" in event:
                    out.error = f"error event: {event['error']}"
                    return out
                if response_id is None:
                    response_id = event["id"]
                elif event["id"] != response_id:
                    out.error = f"chunk id changed from {response_id} to {event['id']}"
                    return out
                for choice in event["choices"]:
                    if choice["delta"].get("content") and out.ttft_s is None:
                        out.ttft_s = time.perf_counter() - started
                    if choice["finish_reason"] is not None:
                        out.finish_reasons[choice["index"]] = choice["finish_reason"]
                if event.get("usage"):
                    out.completion_tokens = event["usage"]["completion_tokens"]
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    out.dropped = True  # leaving the block closes the connection mid-stream
                    return out
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def drive(base: str, plan: LoadPlan, headers: dict | None = None) -> tuple[list[Outcome], float]:
    """Run the plan against `base`; returns one outcome per request (a request cut off by the deadline
    counts as an error) and the wall time."""
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=plan.clients, max_keepalive_connections=plan.clients)
    timeout = httpx.Timeout(plan.request_timeout_s, connect=10.0)

    async def client(number: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(plan.seed * 1_000_003 + number)
        for k in range(plan.requests_per_client):
            outcomes.append(await _one(http, base, plan, number * plan.requests_per_client + k, rng))

    started = time.perf_counter()
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers or {}) as http:
        tasks = [asyncio.create_task(client(i, http)) for i in range(plan.clients)]
        _, pending = await asyncio.wait(tasks, timeout=plan.deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    wall = time.perf_counter() - started
    seen = {o.index for o in outcomes}
    for index in range(plan.num_requests):
        if index not in seen:
            kind = "search" if index % plan.search_every == 0 else "plain"
            outcomes.append(Outcome(index, kind, index % plan.cancel_every == 1,
                                    error=f"not finished within the {plan.deadline_s:.0f} s deadline"))
    return sorted(outcomes, key=lambda o: o.index), wall


# -- the server's view ----------------------------------------------------------------------------

def scrape(base: str, headers: dict | None = None) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", headers=headers or {}, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def idle_view(samples: dict[tuple[str, tuple], float]) -> dict[str, float]:
    """What must be zero once no client is connected: used KV blocks per tier, runtime queues, HTTP in flight."""
    view = {}
    for (name, labels), value in samples.items():
        label = dict(labels)
        if name == "ponder_kv_blocks" and label.get("state") == "used":
            view[f"kv_used[{label.get('tier')}]"] = value
        elif name in ("ponder_requests_running", "ponder_requests_waiting"):
            view[name] = value
        elif name == "ponder_http_requests_in_flight":
            view[f"in_flight[{label.get('endpoint')}]"] = value
    return view


def wait_idle(base: str, timeout_s: float = 15.0, headers: dict | None = None) -> dict[str, float]:
    """Poll /metrics until the idle view is all zeros twice in a row half a second apart (runtime
    statistics lag by one report interval); returns the last view either way."""
    deadline = time.monotonic() + timeout_s
    zeros_seen = 0
    while True:
        view = idle_view(scrape(base, headers))
        has_kv = any(k.startswith("kv_used[") for k in view)
        zeros_seen = zeros_seen + 1 if has_kv and not any(view.values()) else 0
        if zeros_seen >= 2 or time.monotonic() > deadline:
            return view
        time.sleep(0.5)


def statuses(samples: dict[tuple[str, tuple], float]) -> dict[str, float]:
    counts: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if name == "ponder_requests_total":
            status = dict(labels)["status"]
            counts[status] = counts.get(status, 0) + value
    return counts


# -- the report -----------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(len(ordered) * q / 100))) - 1]


def run_load(base: str, plan: LoadPlan, headers: dict | None = None) -> dict:
    """Drive the plan, wait for the server to go idle, and report numbers and broken invariants."""
    before = statuses(scrape(base, headers))
    outcomes, wall = asyncio.run(drive(base, plan, headers))
    idle = wait_idle(base, headers=headers)
    after = statuses(scrape(base, headers))
    answered = {s: after.get(s, 0) - before.get(s, 0) for s in after if after.get(s, 0) != before.get(s, 0)}

    failures = [p for p in (o.problem(plan.max_tokens) for o in outcomes) if p]
    if not any(k.startswith("kv_used[") for k in idle):
        failures.append("/metrics has no ponder_kv_blocks{state=\"used\"} sample")
    failures += [f"{k} is {v:g} after the run, expected 0" for k, v in idle.items() if v]
    failures += [f"the server answered {n:g} requests with HTTP {s}" for s, n in answered.items() if s.startswith("5")]

    completed = [o for o in outcomes if o.completed]
    tokens = sum(o.completion_tokens or 0 for o in completed)
    return {
        "benchmark": "load", "plan": asdict(plan), "requests": len(outcomes), "completed": len(completed),
        "dropped": sum(o.dropped for o in outcomes), "errors": sum(o.error is not None for o in outcomes),
        "lost_or_truncated": sum(1 for o in outcomes if o.error is None and not o.dropped and o.problem(plan.max_tokens)),
        "wall_s": _round(wall), "requests_per_s": _round(len(completed) / wall), "tokens_per_s": _round(tokens / wall),
        "completion_tokens": tokens, **_timings(completed),
        # A search answer streams once the search is over, so its first token comes near its end.
        "by_kind": {kind: {"completed": len(group), **_timings(group)}
                    for kind in ("plain", "search") for group in [[o for o in completed if o.kind == kind]]},
        "server_statuses": {s: int(n) for s, n in sorted(answered.items())}, "idle_after": idle,
        "failures": failures[:50], "ok": not failures,
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _timings(outcomes: list[Outcome]) -> dict:
    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    latency = [o.latency_s for o in outcomes if o.latency_s is not None]
    return {"ttft_p50_s": _round(percentile(ttft, 50)), "ttft_p99_s": _round(percentile(ttft, 99)),
            "latency_p50_s": _round(percentile(latency, 50)), "latency_p99_s": _round(percentile(latency, 99))}


def table(report: dict) -> str:
    plan = report["plan"]
    ms = lambda x: "-" if x is None else f"{x * 1000:.0f} ms"  # noqa: E731
    rows = [f"load benchmark: {plan['clients']} clients x {plan['requests_per_client']} streamed requests "
            f"(1 in {plan['search_every']} tree search, 1 in {plan['cancel_every']} dropped), "
            f"max_tokens {plan['max_tokens']}",
            f"requests: {report['requests']} ({report['completed']} completed, {report['dropped']} dropped, "
            f"{report['errors']} errors, {report['lost_or_truncated']} lost or truncated) in {report['wall_s']:.2f} s: "
            f"{report['requests_per_s']:.2f} requests/s, {report['tokens_per_s']:.1f} tokens/s",
            f"{'requests':<10} {'completed':>9} {'TTFT p50':>10} {'TTFT p99':>10} {'latency p50':>12} {'latency p99':>12}"]
    for name, t in [("all", report), *report["by_kind"].items()]:
        completed = t.get("completed")
        rows.append(f"{name:<10} {completed:>9} {ms(t['ttft_p50_s']):>10} {ms(t['ttft_p99_s']):>10} "
                    f"{ms(t['latency_p50_s']):>12} {ms(t['latency_p99_s']):>12}")
    rows += [f"server statuses: {report['server_statuses']}",
             f"after the run: {report['idle_after']}",
             f"result: {'ok' if report['ok'] else 'FAILED'}"]
    rows += [f"  - {f}" for f in report["failures"]]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = LoadPlan()
    parser.add_argument("--model", default=None, help="model directory (default: a tiny random Llama)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--clients", type=int, default=defaults.clients)
    parser.add_argument("--requests-per-client", type=int, default=defaults.requests_per_client)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--search-every", type=int, default=defaults.search_every)
    parser.add_argument("--cancel-every", type=int, default=defaults.cancel_every)
    parser.add_argument("--deadline", type=float, default=defaults.deadline_s, help="seconds for the whole run")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    plan = LoadPlan(clients=args.clients, requests_per_client=args.requests_per_client, max_tokens=args.max_tokens,
                    search_every=args.search_every, cancel_every=args.cancel_every, deadline_s=args.deadline,
                    seed=args.seed)
    # Enough blocks for every client's sequences at once (a search request runs 4 paths).
    env = {"PONDER_CACHE__NUM_BLOCKS": "4096", "PONDER_CACHE__BLOCK_SIZE": "16"}
    with tempfile.TemporaryDirectory(prefix="ponder-load-") as tmp:
        model = Path(args.model) if args.model else build_tiny_model(Path(tmp) / "tiny-llama")
        with serve(model, Path(tmp) / "server.log", args.device, env) as base:
            report = run_load(base, plan)
    report["model"] = str(args.model or "tiny random llama")
    emit(report, table(report), args.json_path)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
