"""Streaming clients against live servers: ponder, and llama.cpp's llama-server on the same GGUF.

    ponder bench serving-load [--model PATH.gguf] [--clients 1,4,16] [--requests 2] [--max-tokens 64]
                              [--llama-server PATH] [--threads 2] [--json PATH]

Starts `ponder serve` with default settings on the model (default: the embedded SmolLM2 GGUF), then,
where llama.cpp's server is installed (`--llama-server`, or `llama-server` on PATH), `llama-server`
on the same file with `--parallel` the largest client count and the same threads. For each client
count C, C clients at once each send `--requests` streamed chat completions one after another
(greedy, `max_tokens` tokens with `ignore_eos`, a prompt of their own), after one warm-up request.
Per server and C: the tokens all clients received per second of the run, the median stream's decode
rate (tokens after its first, per second after its first) and time to first token, and ponder's
ratio to llama-server. Last, with both servers stopped, the engine `ponder serve` builds decodes
one stream in-process (the same prompt and length), so the one-client figure also reads as what the
process hop and SSE cost: HTTP stream rate / in-process rate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.load import free_port, serve, stop, wait_until
from bench.report import columns, emit

PROMPT = "Write a short story about robot number {client}-{request}, who learns to paint."


def _body(model: str, client: int, request: int, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": PROMPT.format(client=client, request=request)}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True}


async def _stream(http: httpx.AsyncClient, base: str, body: dict) -> dict:
    """One streamed chat completion: seconds to the first and last content token, tokens received."""
    try:
        return await _timed_stream(http, base, body)
    except httpx.HTTPError as exc:  # say which server failed
        raise RuntimeError(f"{base}: {type(exc).__name__}: {exc}") from exc


async def _timed_stream(http: httpx.AsyncClient, base: str, body: dict) -> dict:
    started = time.perf_counter()
    first = last = None
    tokens = 0
    async with http.stream("POST", base + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{base}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    now = time.perf_counter() - started
                    first = now if first is None else first
                    last = now
                    tokens += 1  # both servers send one token a chunk when streaming
    if first is None:
        raise RuntimeError(f"{base}: a stream without content")
    return {"ttft": first, "last": last, "tokens": tokens}


async def _clients(base: str, clients: int, requests: int, max_tokens: int) -> dict:
    # A connection a request: llama-server closes idle keep-alive connections, and a request sent on one
    # it has just closed fails with "Server disconnected without sending a response" (both servers alike).
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        model = (await http.get(base + "/v1/models")).json()["data"][0]["id"]  # the name it serves
        await _stream(http, base, _body(model, -1, 0, 8))  # warm-up

        async def client(index: int) -> list[dict]:
            return [await _stream(http, base, _body(model, index, r, max_tokens)) for r in range(requests)]

        started = time.perf_counter()
        streams = [s for per_client in await asyncio.gather(*(client(i) for i in range(clients))) for s in per_client]
        seconds = time.perf_counter() - started
    rates = sorted((s["tokens"] - 1) / (s["last"] - s["ttft"]) for s in streams if s["last"] > s["ttft"])
    ttfts = sorted(s["ttft"] for s in streams)
    return {"clients": clients, "requests": len(streams), "seconds": round(seconds, 2),
            "tokens": sum(s["tokens"] for s in streams),
            "tokens_per_s": round(sum(s["tokens"] for s in streams) / seconds, 1),
            "stream_tokens_per_s_p50": round(rates[len(rates) // 2], 1) if rates else None,
            "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3)}


@contextlib.contextmanager
def llama_server(binary: str, model: Path, parallel: int, threads: int, context: int, log_path: Path):
    """llama.cpp's server on a free port; yields its base URL once /health is 200."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                                 "--parallel", str(parallel), "-c", str(context * parallel), "-t", str(threads),
                                 "-tb", str(threads)], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(proc, "llama-server", log_path,
                   lambda: httpx.get(base + "/health", timeout=2).status_code == 200, 120)
        yield base
    finally:
        stop(proc)


def in_process_rate(model: Path, max_tokens: int) -> float:
    """One greedy stream's decode tokens/s in the engine `ponder serve` builds, in this process."""
    from bench.decode import best_of, chat_prompt_ids, engine_tokens_per_s
    from runtime.bootstrap import build_engine
    from server.config import Settings

    engine, _ = build_engine(Settings.load(None, model={"path": str(model)}).runtime_options())
    ids = chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": PROMPT.format(client=0, request=0)}])
    engine_tokens_per_s(engine, ids, 1, 8)  # warm-up
    rate = best_of(3, lambda: engine_tokens_per_s(engine, ids, 1, max_tokens))["tokens_per_s"]
    engine.close()
    return rate


def run(model: Path, counts: list[int], requests: int, max_tokens: int, binary: str | None, threads: int) -> dict:
    results: dict = {"model": str(model), "threads": threads, "max_tokens": max_tokens, "systems": {}}
    with tempfile.TemporaryDirectory() as scratch:
        env = {"OMP_NUM_THREADS": str(threads)}
        with serve(model, Path(scratch) / "ponder.log", device="cpu", env=env) as base:
            results["systems"]["ponder"] = [asyncio.run(_clients(base, c, requests, max_tokens)) for c in counts]
        if binary is None:
            results["llama_server_skipped"] = "no llama-server on PATH (llama.cpp's server; pass --llama-server PATH)"
        else:
            context = max_tokens + 128
            with llama_server(binary, model, max(counts), threads, context, Path(scratch) / "llama.log") as base:
                results["systems"]["llama-server"] = [asyncio.run(_clients(base, c, requests, max_tokens))
                                                      for c in counts]
    results["in_process_tokens_per_s_1"] = round(in_process_rate(model, max_tokens), 1)
    _ratios(results)
    return results


def _ratios(results: dict) -> None:
    ponder = results["systems"]["ponder"]
    llama = results["systems"].get("llama-server")
    for i, row in enumerate(ponder):
        if llama is not None:
            row["vs_llama_server"] = round(row["tokens_per_s"] / llama[i]["tokens_per_s"], 2)
        if row["clients"] == 1 and row["stream_tokens_per_s_p50"]:
            row["vs_in_process"] = round(row["stream_tokens_per_s_p50"] / results["in_process_tokens_per_s_1"], 2)


def table(results: dict) -> str:
    header = ["system", "clients", "tok/s", "stream tok/s p50", "TTFT p50 s", "vs llama-server", "vs in-process"]
    rows = [[name, r["clients"], r["tokens_per_s"], r["stream_tokens_per_s_p50"], r["ttft_p50_s"],
             f"{r['vs_llama_server']:.2f}x" if "vs_llama_server" in r else "-",
             f"{r['vs_in_process']:.2f}x" if "vs_in_process" in r else "-"]
            for name, per_count in results["systems"].items() for r in per_count]
    lines = [f"serving-load: {Path(results['model']).name}, {results['threads']} threads, {results['max_tokens']} "
             f"tokens a request; one stream in-process: {results['in_process_tokens_per_s_1']} tok/s",
             *columns(header, rows, 12)]
    if results.get("llama_server_skipped"):
        lines.append(f"llama-server skipped: {results['llama_server_skipped']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench serving-load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--requests", type=int, default=2, help="streamed requests per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--llama-server", default=None, help="llama.cpp's server binary (default: on PATH)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",") if c.strip()]
    if not counts or min(counts) < 1 or args.requests < 1 or args.max_tokens < 2:
        parser.error("--clients: counts of at least 1; --requests at least 1; --max-tokens at least 2")
    if args.model is None:
        from runtime.model.loader import resolve_model

        source = resolve_model(None)
        model = Path(source.directory) / source.gguf_file
    else:
        model = Path(args.model)
    binary = args.llama_server or shutil.which("llama-server")
    results = run(model, counts, args.requests, args.max_tokens, binary, args.threads)
    emit(results, table(results), args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
