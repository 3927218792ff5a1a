"""KV offloading under step-wise beam search, measured on the served engine: every `[scheduler]
policy` runs the same search in a fresh engine whose compute pool is too small for its KV.

    ponder bench kv [--quick] [--json PATH] [--paths N] [--steps N] [--step T] ...

First the search runs with a roomy pool and no tiers: the reference tokens, and the peak blocks the
pool held, which is the search's distinct KV (shared prefixes counted once). Each policy then gets
a compute pool of `--budget-fraction` of that (default 25%), a host tier of `--host-fraction`
(default 25%), and a disk tier for the rest, read past the page cache (O_DIRECT where the file
system allows it). Reports per policy: bytes moved between each pair of tiers, seconds, tokens/s,
the share of time the engine loop stalled on transfers, and whether the tokens are identical to
the reference run. `--quick` runs a small random llama with the embedded tokenizer.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from bench import served
from bench.report import columns, emit
from bench.transfer_model import KVLayout, beam_request_bytes, layerwise_request_bytes
from storage.kv_cache import kv_shape_of


def run(args) -> dict:
    return served.with_model(args, "kv", measure)


def measure(loaded: served.Loaded, args, workdir: str) -> dict:
    prompt = served.prompt_ids(loaded.tokenizer, args.prompt)
    request = served.fixed_step_search(prompt, paths=args.paths, width=args.width, steps=args.steps,
                                       step_tokens=args.step, seed=args.seed)
    path_tokens = len(prompt) + args.steps * args.step
    path_blocks = -(-path_tokens // args.block_size) + 1  # one path's working set, its copied tail too
    roomy = args.paths * path_blocks + path_blocks
    warm = served.fixed_step_search(prompt[:2 * args.block_size], paths=2, width=2, steps=1, step_tokens=4)
    served.drive(served.make_engine(loaded, policy="lbs", num_blocks=roomy, block_size=args.block_size), warm)
    load_before = os.getloadavg()[0]
    reference = served.drive(served.make_engine(loaded, policy="lbs", num_blocks=roomy, block_size=args.block_size),
                             request)
    if reference.error is not None:
        raise SystemExit(f"the resident run failed: {reference.error.message}")
    print(f"# resident: {reference.seconds:.1f} s, peak {reference.peak_used_blocks} blocks", file=sys.stderr)
    distinct = reference.peak_used_blocks
    block_bytes = served.block_bytes(loaded, args.block_size)
    budget = max(math.ceil(distinct * args.budget_fraction), path_blocks)
    host_bytes = int(distinct * args.host_fraction) * block_bytes
    runs: dict[str, list[served.Run]] = {p: [] for p in args.policies}
    read_paths: dict[str, str] = {}
    extras: dict[str, dict] = {}
    for repeat in range(args.repeat):  # interleaved, so a burst of load elsewhere hits every policy
        for policy in args.policies:
            tiers = served.Tiers(host_bytes=host_bytes, disk_dir=os.path.join(workdir, f"disk-{policy}-{repeat}"),
                                 uncached_reads=not args.page_cache_reads)
            engine = served.make_engine(loaded, policy=policy, num_blocks=budget, block_size=args.block_size,
                                        tiers=tiers)
            result = served.drive(engine, request)
            if result.error is not None:
                raise SystemExit(f"{policy}: the search failed: {result.error.message}")
            disk = engine.tier_chain.disk
            read_paths[policy] = disk.read_path
            extras.setdefault(policy, {"groups": engine.planner.num_groups, "preemptions": engine.stats["preemptions"],
                                       "disk_group_reads": disk.num_group_reads})
            served.release(engine)
            runs[policy].append(result)
            print(f"# {policy}: {result.seconds:.1f} s", file=sys.stderr)
    compute = "gpu" if loaded.device.type == "cuda" else "cpu"
    policies = {p: summary(rs, compute, reference.outputs) | extras[p] for p, rs in runs.items()}
    config = loaded.model.config.get_text_config()
    shape = kv_shape_of(loaded.model.config, args.block_size)
    layout = KVLayout(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                      torch.tensor([], dtype=next(loaded.model.parameters()).dtype).element_size())
    generated = args.steps * args.step
    results = {
        "model": loaded.name, "device": str(loaded.device), "threads": args.threads,
        "repeat": args.repeat, "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "workload": {"paths": args.paths, "beam_width": args.width, "step_tokens": args.step, "steps": args.steps,
                     "prompt_tokens": len(prompt), "block_size": args.block_size, "layers": config.num_hidden_layers},
        "block_bytes": block_bytes,
        "resident": {"seconds": round(reference.seconds, 3), "tokens_per_s": _rate(reference),
                     "peak_blocks": distinct},
        "distinct_kv_blocks": distinct, "distinct_kv_bytes": distinct * block_bytes,
        "budget_blocks": budget, "budget_bytes": budget * block_bytes,
        "budget_fraction": round(budget / distinct, 4), "budget_fraction_asked": args.budget_fraction,
        "budget_raised_to_one_path": budget == path_blocks and budget > distinct * args.budget_fraction,
        "host_bytes": host_bytes, "host_blocks": host_bytes // block_bytes,
        "disk_read_path": sorted(set(read_paths.values())),
        "disk_in_play": any(p["bytes_moved"].get(f"{src}->disk") for p in policies.values() for src in ("host", "compute")),
        "policies": policies,
        "outputs_identical": all(p["outputs_identical"] for p in policies.values()),
        "paper_model_bytes": {
            "token_eq3": layerwise_request_bytes(layout, args.paths, len(prompt), generated, budget * block_bytes),
            "beam_eq5": beam_request_bytes(layout, args.paths, len(prompt), generated, args.step)},
    }
    for name, suffix in (("lbs", ""), ("lbs_no_prefix", "_no_prefix")):
        if "token" in policies and name in policies:
            token, other = policies["token"], policies[name]
            results[f"ratio_bytes{suffix}"] = (other["bytes_into_compute"] / token["bytes_into_compute"]
                                               if token["bytes_into_compute"] else None)
            results[f"speedup{suffix}"] = round(token["seconds"] / other["seconds"], 3)
    return results


def summary(runs: list[served.Run], compute: str, reference: tuple) -> dict:
    """The fastest repeat's figures (bytes and tokens are the same in every repeat)."""
    best = min(runs, key=lambda r: r.seconds)
    moved = served.moved_bytes(best, compute)
    return {"seconds": round(best.seconds, 3), "seconds_each": [round(r.seconds, 3) for r in runs],
            "tokens_per_s": _rate(best), "bytes_moved": moved,
            "bytes_into_compute": sum(v for k, v in moved.items() if k.endswith("->compute")),
            "stall_seconds": round(best.stall_seconds, 4), "stall_share": round(best.stall_seconds / best.seconds, 4),
            "outputs_identical": all(r.outputs == reference for r in runs)}


def _rate(run: served.Run) -> float:
    return round(run.tokens_generated / run.seconds, 2) if run.seconds else 0.0


def table(r: dict) -> str:
    w, mib = r["workload"], 2 ** 20
    rows = [f"kv offload benchmark (served engine): {r['model']} on {r['device']} ({r['threads']} threads, "
            f"load average {r['load_average'][0]}, fastest of {r['repeat']}), beam search of {w['paths']} paths "
            f"(width {w['beam_width']}), prompt {w['prompt_tokens']}, {w['steps']} steps of {w['step_tokens']} tokens",
            f"distinct KV {r['distinct_kv_blocks']} blocks ({r['distinct_kv_bytes'] / mib:.1f} MiB, the resident "
            f"run's peak); compute pool {r['budget_blocks']} blocks ({r['budget_fraction']:.0%}), host tier "
            f"{r['host_blocks']} blocks, the rest on disk (reads: {', '.join(r['disk_read_path'])})"]
    pairs = sorted({k for p in r["policies"].values() for k in p["bytes_moved"]})
    body = []
    for name, p in r["policies"].items():
        body.append([name, *(f"{p['bytes_moved'].get(k, 0) / mib:.2f}" for k in pairs), f"{p['seconds']:.2f}",
                     f"{p['tokens_per_s']:.1f}", f"{p['stall_share']:.1%}", p["groups"], str(p["outputs_identical"])])
    body.append(["resident", *("-" for _ in pairs), f"{r['resident']['seconds']:.2f}",
                 f"{r['resident']['tokens_per_s']:.1f}", "-", "-", "reference"])
    rows += columns(["policy", *(f"MiB {k}" for k in pairs), "seconds", "tok/s", "stall", "groups", "same tokens"],
                    body)
    if "ratio_bytes" in r:
        ratio = "n/a (token moved nothing)" if r["ratio_bytes"] is None else f"{r['ratio_bytes']:.2%}"
        rows.append(f"lbs vs token: bytes into compute {ratio}, {r['speedup']:.2f}x faster")
    rows.append(f"outputs identical across policies and the resident run: {r['outputs_identical']}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench kv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a random 4-layer llama, 8 paths, 3 steps of 16 tokens (about a minute)")
    parser.add_argument("--paths", type=int, default=None, help="paths kept (16; quick 8)")
    parser.add_argument("--width", type=int, default=2, help="children per kept path")
    parser.add_argument("--step", type=int, default=None, help="tokens per search step (32; quick 16)")
    parser.add_argument("--steps", type=int, default=None, help="search steps (8; quick 3)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (128; quick 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-fraction", type=float, default=0.25,
                        help="compute pool as a share of the search's distinct KV")
    parser.add_argument("--host-fraction", type=float, default=0.25,
                        help="host tier as a share of the distinct KV; what it cannot hold goes to disk")
    parser.add_argument("--policies", nargs="+", default=["token", "lbs_no_prefix", "lbs"],
                        help="`[scheduler] policy` values to run (the engine refuses one it does not have)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per policy, interleaved; the fastest is reported")
    served.add_arguments(parser)
    args = parser.parse_args(argv)
    quick = dict(paths=8, step=16, steps=3, prompt=64)
    full = dict(paths=16, step=32, steps=8, prompt=128)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    results = run(args)
    emit(results, table(results), args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
