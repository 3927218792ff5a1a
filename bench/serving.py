"""The served search under each `[scheduler] policy`, with a compute pool too small for its KV.

One beam search (judge verifier) per configuration, each in a fresh engine over the same model:
`token`, `lbs_no_prefix` and `lbs` with the compute pool at `--pool-fraction` of the blocks the
search holds at its peak (measured in a roomy run first) and a host tier below it, then `lbs`
with the roomy pool with and without speculative beam extension. Reports seconds, how often a
path's blocks were taken (preempted or released), the groups run, blocks moved between tiers,
speculative tokens used by their path, adopted by its children and dropped, and whether every
configuration returned the same tokens.

    ponder bench serving [--quick] [--pool-fraction 0.25] [--json PATH]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench import served
from bench.report import emit
from bench.threads import torch_threads
from bench.search import PROBLEMS, messages_for
from runtime.wire.params import SamplingParams, SearchParams
from runtime.wire.protocol import GenerateRequest


def search(engine, problem: str, n: int, steps: int, step_tokens: int, seed: int) -> dict:
    request = GenerateRequest(
        request_id=f"bench-serving-{time.monotonic_ns()}", endpoint="chat", messages=messages_for(problem),
        sampling=SamplingParams(max_tokens=steps * step_tokens, temperature=0.8, seed=seed, n=n),
        search=SearchParams(strategy="beam", n=n, beam_width=4, max_steps=steps, max_step_tokens=step_tokens,
                            step_delimiter="\n\n", verifier="judge"))
    before = dict(engine.stats, speculative_tokens=dict(engine.stats["speculative_tokens"]))
    groups_before = engine.planner.num_groups
    run = served.drive(engine, request)
    finished = run.finished
    if finished is None or finished.search is None:
        raise RuntimeError(f"the search did not finish: {run.error}")
    spec = {k: v - before["speculative_tokens"].get(k, 0) for k, v in engine.stats["speculative_tokens"].items()}
    return {"seconds": round(run.seconds, 2), "peak_blocks": run.peak_used_blocks,
            "prompt_tokens": finished.prompt_tokens,
            "blocks_taken": engine.stats["preemptions"] - before["preemptions"],
            "groups": engine.planner.num_groups - groups_before, "steps": finished.search.steps,
            "tokens_generated": finished.search.tokens_generated,
            "speculative_used": spec.get("used", 0), "speculative_discarded": spec.get("discarded", 0),
            "speculative_adopted": spec.get("adopted", 0),
            "tier_bytes": sum(run.transfer_bytes.values()), "output": [list(o) for o in run.outputs]}


def run(model: str | None, quick: bool, pool_fraction: float, block_size: int = 16, seed: int = 0) -> dict:
    n, steps, step_tokens = (8, 3, 16) if quick else (16, 4, 32)
    problem = PROBLEMS[0]
    loaded = served.load(model)

    def engine_with(num_blocks: int, policy: str, speculative: bool, host_bytes: int = 0):
        tiers = served.Tiers(host_bytes=host_bytes, disk_dir=None) if host_bytes else None
        engine = served.make_engine(loaded, policy=policy, num_blocks=num_blocks, block_size=block_size,
                                    tiers=tiers, speculative_extension=speculative)
        search(engine, "What is 2 + 3?", 2, 1, 4, seed)  # warm-up
        return engine

    roomy = engine_with(4096, "lbs", False)
    reference = search(roomy, problem, n, steps, step_tokens, seed)
    # At least what one path and its judge question need (the server refuses less).
    path_blocks = roomy.kv.num_blocks_for(reference["prompt_tokens"] + steps * step_tokens)
    pool = max(2 * path_blocks, int(reference["peak_blocks"] * pool_fraction))
    host = 4 * reference["peak_blocks"] * served.block_bytes(loaded, block_size)
    del roomy
    runs = {"lbs roomy": dict(reference)}
    for policy in ("token", "lbs_no_prefix", "lbs"):
        runs[f"{policy} pool"] = search(engine_with(pool, policy, False, host), problem, n, steps, step_tokens, seed)
    runs["lbs roomy +spec"] = search(engine_with(4096, "lbs", True), problem, n, steps, step_tokens, seed)
    for r in runs.values():
        output = r.pop("output")
        r["identical"] = output == reference["output"]
        r["same_paths"] = sorted(output) == sorted(reference["output"])  # the same texts, in any order
    identical = all(r["identical"] for r in runs.values())
    return {"model": loaded.name, "threads": torch.get_num_threads(), "n": n, "beam_width": 4, "steps": steps,
            "step_tokens": step_tokens, "pool_blocks": pool, "peak_blocks": reference["peak_blocks"],
            "runs": runs, "outputs_identical": identical,
            "lbs_vs_token": round(runs["token pool"]["seconds"] / runs["lbs pool"]["seconds"], 2),
            "speculation_speedup": round(runs["lbs roomy"]["seconds"] / runs["lbs roomy +spec"]["seconds"], 2)}


def table(results: dict) -> str:
    rows = [f"served search under each policy: {results['model']}, beam n={results['n']} width 4, "
            f"{results['steps']} steps of <= {results['step_tokens']} tokens, judge; pool {results['pool_blocks']} "
            f"of {results['peak_blocks']} peak blocks",
            f"{'configuration':<18} {'seconds':>8} {'blocks taken':>13} {'groups':>7} {'tier MB':>8} "
            f"{'spec used':>10} {'spec adopted':>13} {'spec dropped':>13} {'same tokens':>12}"]
    for name, r in results["runs"].items():
        rows.append(f"{name:<18} {r['seconds']:>8.2f} {r['blocks_taken']:>13} {r['groups']:>7} "
                    f"{r['tier_bytes'] / 1e6:>8.1f} {r['speculative_used']:>10} {r['speculative_adopted']:>13} "
                    f"{r['speculative_discarded']:>13} "
                    f"{str(r['identical']):>12}")
    rows.append(f"outputs identical: {results['outputs_identical']}; token/lbs seconds {results['lbs_vs_token']}x; "
                f"speculation {results['speculation_speedup']}x")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench serving", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--quick", action="store_true", help="8 paths, 3 steps of 16 tokens")
    parser.add_argument("--pool-fraction", type=float, default=0.25)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    with torch_threads(args.threads):
        results = run(args.model, args.quick, args.pool_fraction, args.block_size)
    emit(results, table(results), args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
