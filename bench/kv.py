"""KV offloading under step-wise beam search: layer-wise offload (`token`) against locality-aware beam
scheduling without (`lbs_no_prefix`) and with prefix sharing (`lbs`), one workload, one process.

    ponder bench kv [--quick] [--json PATH] [--plot PATH] [--beams N] [--steps N] ...

The compute tier gets a quarter of the search's total KV, counted as the paper counts it (every
final beam's KV, a shared prefix once per beam: what a per-beam cache holds). On CPU the compute
tier is a RAM pool and, by default, there is no host tier: what is not resident goes to the disk
tier in a temporary directory. Prints one JSON line, then a table, and writes a PNG plot next to
the JSON (or to bench/out/). `--quick` runs a tiny random llama built in a temporary directory.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

import torch

from bench.report import emit, plot_path
from bench.threads import torch_threads
from runtime.offload import POLICIES, RunReport, SearchSpec, TierSpec, run_offloaded

OUT_DIR = Path(__file__).resolve().parent / "out"
QUESTION = (
    "A bakery sells muffins for $3 and cookies for $1.50. On Monday it sold 48 muffins and twice "
    "as many cookies. On Tuesday it sold 25% fewer muffins and 30 more cookies than on Monday. "
    "A muffin costs $1.20 to make, a cookie $0.40, and rent and wages are $95 a day. What was the "
    "profit over the two days? Think step by step and end with 'The answer is: X'.")


def tiny_llama(directory: Path, seed: int = 0):
    """A random 8-layer llama saved as safetensors and loaded the way ponder loads models."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from runtime import attention
    from runtime.loader import ModelSource, load_causal_lm

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper than uniform, like a trained model's logits
    model.save_pretrained(directory, safe_serialization=True)
    return load_causal_lm(ModelSource("tiny-llama", str(directory)), torch.device("cpu"),
                          torch.float32, attention.register()), "tiny-llama (random, 8 layers)"


def default_model(device: str):
    from runtime.bootstrap import build_engine
    from runtime.protocol import RuntimeOptions

    engine, source = build_engine(RuntimeOptions(device=device, num_blocks=1))
    return engine.model, source.name, engine.tokenizer


def prompt_ids(tokenizer, vocab: int, length: int) -> list[int]:
    """A chat-formatted question, its last `length` tokens (the template's system text is what a
    cut drops; repeated if too short), or seeded random ids for a model without a tokenizer."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(7)
        return torch.randint(3, vocab, (length,), generator=g).tolist()
    messages = [{"role": "user", "content": QUESTION}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    while len(ids) < length:
        ids = ids + ids
    return ids[-length:]


def paper_model_bytes(spec: SearchSpec, num_layers: int, block_bytes: int, block_size: int,
                      budget_bytes: int) -> dict[str, float]:
    """The paper's transfer-volume model for this workload: Eq. 1-3 (layer-wise, token by token)
    and Eq. 4-5 (beam scheduling, every beam's KV once per step), in bytes."""
    kv = block_bytes / (num_layers * block_size)  # one layer, one beam, one token
    prompt, generated = len(spec.prompt_ids), spec.step_tokens * spec.num_steps
    token = 0.0
    for i in range(generated):
        kv_layer = spec.num_beams * (i + prompt) * kv
        resident = min(num_layers, math.floor(budget_bytes / kv_layer))
        token += (num_layers - resident) * kv_layer
    beam = sum(spec.num_beams * (i * spec.step_tokens + prompt) * kv * num_layers
               for i in range(generated // spec.step_tokens))
    return {"token_eq3": token, "beam_eq5": beam, "ratio": beam / token if token else 0.0}


def run(args) -> dict:
    with torch_threads(args.threads), tempfile.TemporaryDirectory(prefix="ponder-bench-kv-") as workdir:
        return _run(args, workdir)


def _run(args, workdir: str) -> dict:
    if args.quick:
        (model, model_name), tokenizer = tiny_llama(Path(workdir) / "model"), None
    else:
        model, model_name, tokenizer = default_model(args.device)
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = prompt_ids(tokenizer, vocab, args.prompt)
    spec = SearchSpec(prompt_ids=tuple(prompt), num_beams=args.beams, beam_width=args.width,
                      step_tokens=args.step, num_steps=args.steps, seed=args.seed)
    config = model.config.get_text_config()
    num_layers = config.num_hidden_layers
    probe = run_offloaded(model, SearchSpec(prompt_ids=spec.prompt_ids[:args.block_size + 1],
                                            num_beams=2, step_tokens=2, num_steps=1),
                          TierSpec(budget_blocks=16, block_size=args.block_size))  # warm-up
    block_bytes = probe.block_bytes
    blocks_per_beam = -(-spec.num_computed_tokens // args.block_size)
    total_blocks = spec.num_beams * blocks_per_beam
    budget = args.budget_blocks or max(1, int(total_blocks * args.budget_fraction))
    host_fraction = args.host_fraction if args.host_fraction is not None else \
        (1.0 if device.type == "cuda" else 0.0)
    tiers = TierSpec(budget_blocks=budget, block_size=args.block_size,
                     host_bytes=int(total_blocks * host_fraction * block_bytes),
                     disk_dir=workdir, disk_bytes=max(64 << 20, 4 * total_blocks * block_bytes))
    reports: dict[str, RunReport] = {}
    times: dict[str, list[float]] = {p: [] for p in args.policies}
    outputs: set[tuple] = set()  # the final tokens of every run
    load_before = os.getloadavg()[0]
    for _ in range(args.repeat):  # interleaved, so a burst of load elsewhere hits every policy
        for policy in args.policies:
            report = run_offloaded(model, spec, tiers, policy)
            times[policy].append(report.seconds)
            outputs.add(report.tokens)
            print(f"# {policy}: {report.seconds:.1f} s", file=sys.stderr)
            if policy not in reports or report.seconds < reports[policy].seconds:
                reports[policy] = report  # bytes and tokens are the same in every repeat
    first = next(iter(reports.values()))
    results = {
        "model": model_name, "device": str(device), "threads": args.threads,
        "repeat": args.repeat, "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "workload": {"beams": spec.num_beams, "beam_width": spec.beam_width,
                     "step_tokens": spec.step_tokens, "prompt_tokens": len(spec.prompt_ids),
                     "steps": spec.num_steps,
                     "generated_tokens_per_beam": 1 + spec.step_tokens * spec.num_steps,
                     "block_size": args.block_size, "layers": num_layers},
        "total_kv_blocks": total_blocks, "total_kv_bytes": total_blocks * block_bytes,
        "distinct_kv_blocks": first.distinct_blocks,
        "budget_blocks": budget, "budget_bytes": budget * block_bytes,
        "host_bytes": tiers.host_bytes, "disk_tier": True,
        "policies": {name: {**_summary(r), "seconds_each": [round(t, 3) for t in times[name]]}
                     for name, r in reports.items()},
        "paper_model_bytes": paper_model_bytes(spec, num_layers, block_bytes, args.block_size,
                                               budget * block_bytes),
    }
    if "token" in reports and "lbs" in reports:
        token, lbs = reports["token"], reports["lbs"]
        results["ratio_bytes"] = lbs.bytes_in / token.bytes_in if token.bytes_in else None
        results["speedup"] = token.seconds / lbs.seconds
    if "token" in reports and "lbs_no_prefix" in reports:
        token, ablation = reports["token"], reports["lbs_no_prefix"]
        results["ratio_bytes_no_prefix"] = ablation.bytes_in / token.bytes_in if token.bytes_in else None
        results["speedup_no_prefix"] = token.seconds / ablation.seconds
    results["outputs_identical"] = len(outputs) == 1  # every run of every policy
    results["max_score_difference"] = max(abs(a - b) for r in reports.values()
                                          for a, b in zip(r.scores, first.scores))
    results["final_tokens"] = [list(t) for t in first.tokens]
    return results


def _summary(r: RunReport) -> dict:
    return {"bytes_in": r.bytes_in, "bytes_out": r.bytes_out, "bytes_prefetched": r.bytes_prefetched,
            "bytes_moved": {k: v for k, v in r.bytes_moved.items() if v},
            "seconds": round(r.seconds, 3), "stall_seconds": round(r.stall_seconds, 3),
            "stall_share": round(r.stall_share, 4), "groups_per_step": list(r.groups_per_step),
            "group_sizes": [list(g) for g in r.group_sizes], "forwards": r.num_forwards,
            "max_resident_blocks": r.max_resident_blocks, "resident_layers": list(r.resident_layers)}


def table(results: dict) -> str:
    w = results["workload"]
    rows = [f"kv offload benchmark: {results['model']} on {results['device']} ({results['threads']} "
            f"compute threads, load average {results['load_average'][0]}, fastest of "
            f"{results['repeat']}), {w['beams']} beams (width {w['beam_width']}), prompt "
            f"{w['prompt_tokens']}, {w['steps']} steps of {w['step_tokens']} tokens",
            f"compute tier {results['budget_blocks']} of {results['total_kv_blocks']} blocks "
            f"({results['budget_bytes'] / 2**20:.1f} of {results['total_kv_bytes'] / 2**20:.1f} MiB; "
            f"{results['distinct_kv_blocks']} distinct blocks at the end), host tier "
            f"{results['host_bytes'] / 2**20:.1f} MiB, the rest on disk",
            f"{'policy':<15} {'MiB in':>11} {'vs token':>9} {'seconds':>9} {'speedup':>8} "
            f"{'stall':>6} {'groups/step':>13}"]
    policies = results["policies"]
    base = policies.get("token")
    for name, p in policies.items():
        ratio = p["bytes_in"] / base["bytes_in"] if base and base["bytes_in"] else float("nan")
        speed = base["seconds"] / p["seconds"] if base else float("nan")
        groups = p["groups_per_step"]
        rows.append(f"{name:<15} {p['bytes_in'] / 2**20:>11.1f} {ratio:>9.4f} {p['seconds']:>9.2f} "
                    f"{speed:>7.2f}x {p['stall_share']:>6.1%} {min(groups):>6}-{max(groups):<6}")
    rows.append(f"outputs identical across policies: {results['outputs_identical']} (largest score "
                f"difference {results['max_score_difference']:.2e})")
    return "\n".join(rows)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = results["policies"]
    names = list(policies)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [max(policies[n]["bytes_in"], 1) / 2**20 for n in names], color="#4477aa")
    axes[0].set_yscale("log")
    axes[0].set_title("KV moved into the compute tier (MiB)")
    stall = [policies[n]["stall_seconds"] for n in names]
    busy = [policies[n]["seconds"] - s for n, s in zip(names, stall)]
    axes[1].bar(names, busy, label="compute and other", color="#66aa55")
    axes[1].bar(names, stall, bottom=busy, label="stalled on transfers", color="#cc6677")
    axes[1].set_title("seconds")
    axes[1].legend()
    for n in names:
        axes[2].plot(range(1, len(policies[n]["groups_per_step"]) + 1),
                     policies[n]["groups_per_step"], marker="o", label=n)
    axes[2].set_title("beam groups per search step")
    axes[2].yaxis.get_major_locator().set_params(integer=True)
    axes[2].set_xlabel("step")
    axes[2].legend()
    w = results["workload"]
    fig.suptitle(f"{results['model']}: {w['beams']} beams, step {w['step_tokens']}, compute tier "
                 f"{results['budget_blocks']}/{results['total_kv_blocks']} blocks")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench kv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny random llama (under two minutes)")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    parser.add_argument("--plot", dest="plot_path", default=None,
                        help="PNG path (default: next to --json, else bench/out/kv.png)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    parser.add_argument("--beams", type=int, default=16)
    parser.add_argument("--width", type=int, default=2, help="children per kept beam")
    parser.add_argument("--step", type=int, default=32, help="tokens per search step")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budget-fraction", type=float, default=0.25,
                        help="compute tier as a share of the total KV")
    parser.add_argument("--budget-blocks", type=int, default=None,
                        help="compute tier in blocks (overrides --budget-fraction)")
    parser.add_argument("--host-fraction", type=float, default=None,
                        help="host tier as a share of the total KV (default: 0 on CPU, 1 on CUDA)")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="compute threads (default: all cores but one, left to transfers)")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per policy, interleaved; the fastest is reported")
    args = parser.parse_args(argv)
    results = run(args)
    path = plot_path(args.plot_path, args.json_path, OUT_DIR / ("kv-quick.png" if args.quick else "kv.png"))
    results["plot"] = str(path)
    plot(results, path)
    emit(results, table(results), args.json_path, {k: v for k, v in results.items() if k != "final_tokens"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
