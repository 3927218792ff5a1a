"""Head-wise KV offloading (HeadInfer) in the served engine: one long request whose KV is larger than
the compute pool, served by streaming (layer, KV-head group) pieces through it.

    ponder bench headwise [--quick] [--json PATH] [--prompt N] [--tokens N] [--pool-fraction F]

Decodes `--tokens` greedy tokens after a `--prompt`-token prompt three ways: transformers'
`generate` (its own resident cache), the engine with a pool that holds the whole request, and the
engine with a pool of `--pool-fraction` of the request's blocks (default a quarter), a host tier of
`--host-fraction` and a disk tier for the rest. Reports the bytes moved per tier pair, seconds,
tokens/s, the share of time stalled on transfers and whether all three decoded the same tokens.
An engine without head-wise offload refuses the request; the benchmark then stops and says so.
`--quick` runs a small random llama with the embedded tokenizer.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

from bench import served
from bench.report import columns, emit
from runtime.wire.params import SamplingParams
from runtime.wire.protocol import GenerateRequest


def hf_generate(model, prompt: list[int], tokens: int) -> dict:
    """Greedy `generate` with sdpa: the tokens a resident cache decodes."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    try:
        with torch.inference_mode():
            began = time.perf_counter()
            out = model.generate(ids, max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            seconds = time.perf_counter() - began
    finally:
        model.set_attn_implementation(previous)
    return {"tokens": out[0, len(prompt):].tolist(), "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2)}


def greedy(prompt: list[int], tokens: int, request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, endpoint="completion", prompt_token_ids=tuple(prompt),
                           sampling=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))


def run(args) -> dict:
    return served.with_model(args, "headwise", measure)


def measure(loaded: served.Loaded, args, workdir: str) -> dict:
    prompt = served.prompt_ids(loaded.tokenizer, args.prompt)
    request_blocks = -(-(len(prompt) + args.tokens) // args.block_size)
    block_bytes = served.block_bytes(loaded, args.block_size)
    # One request alone: no schedule to be invariant to, and deterministic prefill (one query at a
    # time) would make the resident run the slow one.
    resident_engine = served.make_engine(loaded, policy="lbs", num_blocks=request_blocks + 1,
                                         block_size=args.block_size, max_num_seqs=1, batch_invariant=False)
    served.drive(resident_engine, greedy(prompt[:2 * args.block_size], 2, "warm-up"))
    load_before = os.getloadavg()[0]
    reference = hf_generate(loaded.model, prompt, args.tokens)
    resident = served.drive(resident_engine, greedy(prompt, args.tokens, "resident"))
    print(f"# resident: {resident.seconds:.1f} s", file=sys.stderr)
    pool = max(1, math.ceil(request_blocks * args.pool_fraction))
    host_bytes = int(request_blocks * args.host_fraction) * block_bytes
    tiers = served.Tiers(host_bytes=host_bytes, disk_dir=os.path.join(workdir, "disk"),
                         uncached_reads=not args.page_cache_reads)
    engine = served.make_engine(loaded, policy="lbs", num_blocks=pool, block_size=args.block_size, tiers=tiers,
                                max_num_seqs=1, kv_granularity="head", max_model_len=len(prompt) + args.tokens,
                                batch_invariant=False)
    offloaded = served.drive(engine, greedy(prompt, args.tokens, "offloaded"))
    if offloaded.error is not None:
        raise SystemExit(
            f"head-wise offload is not served by this engine: a request of {request_blocks} blocks "
            f"({len(prompt)} prompt + {args.tokens} new tokens) over a {pool}-block compute pool was refused "
            f"({offloaded.error.status}: {offloaded.error.message})")
    print(f"# offloaded: {offloaded.seconds:.1f} s", file=sys.stderr)
    compute = "gpu" if loaded.device.type == "cuda" else "cpu"
    tokens = list(offloaded.outputs[0]) if offloaded.outputs else []
    return {
        "model": loaded.name, "device": str(loaded.device), "threads": args.threads,
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "prompt_tokens": len(prompt), "new_tokens": args.tokens, "block_size": args.block_size,
        "block_bytes": block_bytes, "request_blocks": request_blocks, "pool_blocks": pool,
        "pool_fraction": round(pool / request_blocks, 4), "host_bytes": host_bytes,
        "disk_read_path": engine.tier_chain.disk.read_path,
        "offloaded": _summary(offloaded, compute), "resident": _summary(resident, compute),
        "transformers_generate": {k: v for k, v in reference.items() if k != "tokens"},
        "outputs_identical": tokens == list(resident.outputs[0]) == reference["tokens"],
        "tokens": tokens,
    }


def _summary(run: served.Run, compute: str) -> dict:
    moved = served.moved_bytes(run, compute)
    return {"seconds": round(run.seconds, 3), "tokens_per_s": round(run.tokens_generated / run.seconds, 2),
            "bytes_moved": moved, "bytes_into_compute": sum(v for k, v in moved.items() if k.endswith("->compute")),
            "stall_seconds": round(run.stall_seconds, 4), "stall_share": round(run.stall_seconds / run.seconds, 4),
            "peak_used_blocks": run.peak_used_blocks}


def table(r: dict) -> str:
    mib = 2 ** 20
    rows = [f"head-wise offload (served engine): {r['model']} on {r['device']} ({r['threads']} threads, load "
            f"average {r['load_average'][0]}), prompt {r['prompt_tokens']}, {r['new_tokens']} new tokens; the "
            f"request needs {r['request_blocks']} blocks, the pool holds {r['pool_blocks']} "
            f"({r['pool_fraction']:.0%}), host tier {r['host_bytes'] / mib:.1f} MiB, the rest on disk "
            f"(reads: {r['disk_read_path']})"]
    hf = r["transformers_generate"]
    body = [[name, f"{s['bytes_into_compute'] / mib:.2f}", f"{s['seconds']:.2f}", f"{s['tokens_per_s']:.1f}",
             f"{s['stall_share']:.1%}"] for name, s in (("offloaded", r["offloaded"]), ("resident", r["resident"]))]
    body.append(["transformers generate", "-", f"{hf['seconds']:.2f}", f"{hf['tokens_per_s']:.1f}", "-"])
    rows += columns(["run", "MiB into compute", "seconds", "tok/s", "stall"], body, first_width=22)
    rows.append("bytes moved: " + ", ".join(f"{k} {v / mib:.2f} MiB" for k, v in r["offloaded"]["bytes_moved"].items()))
    rows.append(f"outputs identical (offloaded, resident, generate): {r['outputs_identical']}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench headwise", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a random 4-layer llama, 512-token prompt")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (2048; quick 512)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens to decode (32; quick 16)")
    parser.add_argument("--pool-fraction", type=float, default=0.25,
                        help="compute pool as a share of the request's blocks")
    parser.add_argument("--host-fraction", type=float, default=0.5,
                        help="host tier as a share of the request's blocks; the rest goes to disk")
    served.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.prompt is None:
        args.prompt = 512 if args.quick else 2048
    if args.tokens is None:
        args.tokens = 16 if args.quick else 32
    results = run(args)
    emit(results, table(results), args.json_path, {k: v for k, v in results.items() if k != "tokens"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
