"""A MODEL, not a measurement: the served engine's real search trace replayed at LLaMA-2-7B's KV shape
on a desktop-GPU profile, lbs against layer-wise token-by-token offload (`token`).

    python -m bench.simulate [--quick] [--json PATH] [--paths 64] [--steps-of 32 64 128] ...

For each step length, the served engine runs a step-wise beam search (fixed-length steps, the
model's confidence as the verifier) and a small hook on that engine records, at every step, which
blocks each path holds and shares (TraceRecorder, below). The trace is then replayed through
the engine's grouping code with every block priced as LLaMA-2-7B's KV, and each step's time comes
from the roofline (scheduler.roofline) with the stated device profile (bench.sim_replay). The trace
is recorded by default on a random 2-layer llama with the embedded tokenizer (`--model` records it
on another): the tree of forks is what the engine's beam search does; the model only picks tokens.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench import served
from bench.report import columns, emit
from bench.sim_replay import Device, TracePath, TraceStep, replay_lbs, replay_token
from bench.transfer_model import KVLayout, beam_request_bytes, layerwise_request_bytes
from scheduler.roofline import DevicePeaks, ModelCost
from storage.block_hash import hash_blocks

LLAMA2_7B = KVLayout(num_layers=32, num_kv_heads=32, head_dim=128, dtype_bytes=2)
LLAMA2_7B_PARAMETERS = 6_738_415_616
# The desktop-GPU profile (RTX 4090 class): fp16 TFLOP/s and device-memory TB/s (bench example prices its steps on it too).
DESKTOP_TFLOPS, DESKTOP_MEMORY_TBPS = 165.0, 1.0


class TraceRecorder:
    """Records the block trace of one engine's searches through the one call every search step
    makes, `Engine.plan_step(seqs, step_tokens)`: the paths as the planner sees them when a step
    begins, and, at the next step (or `close`), the full blocks they held when it ended."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps: list[TraceStep] = []
        self._open: list[tuple] = []  # (seq, blocks at the start, tokens, step tokens) of the step running
        self._plan_step = engine.plan_step
        engine.plan_step = self._record

    def _record(self, seqs, step_tokens):
        self._close_step()
        planner = self.engine.planner
        self._open = [(s, tuple(planner.block_keys(s)), len(s.token_ids), t) for s, t in zip(seqs, step_tokens)]
        return self._plan_step(seqs, step_tokens)

    def _close_step(self) -> None:
        if not self._open:
            return
        size, key = self.engine.kv.block_size, self.engine.kv.extra_key
        paths = []
        for seq, blocks, num_tokens, step_tokens in self._open:
            full = max(0, len(seq.token_ids) - 1) // size
            after = tuple(hash_blocks(seq.token_ids[:full * size], size, key))
            paths.append(TracePath(blocks, num_tokens, step_tokens, after))
        self.steps.append(TraceStep(tuple(paths)))
        self._open = []

    def close(self) -> list[TraceStep]:
        self._close_step()
        self.engine.plan_step = self._plan_step
        return self.steps


def record_trace(loaded: served.Loaded, *, paths: int, width: int, prompt: int, generated: int, step_tokens: int,
                 block_size: int, seed: int) -> tuple[list[TraceStep], served.Run]:
    request = served.fixed_step_search(served.prompt_ids(loaded.tokenizer, prompt), paths=paths, width=width,
                                       steps=generated // step_tokens, step_tokens=step_tokens, seed=seed)
    roomy = paths * (-(-(prompt + generated) // block_size) + 2)
    engine = served.make_engine(loaded, policy="lbs", num_blocks=roomy, block_size=block_size,
                                max_num_seqs=paths, batch_invariant=False)
    recorder = TraceRecorder(engine)
    run = served.drive(engine, request)
    if run.error is not None:
        raise SystemExit(f"recording the trace failed: {run.error.message}")
    return recorder.close(), run


def llama2_7b_cost(block_size: int) -> ModelCost:
    return ModelCost(weight_bytes=2 * LLAMA2_7B_PARAMETERS, flops_per_token=2 * LLAMA2_7B_PARAMETERS,
                     attention_flops_per_context_token=4 * 32 * 32 * 128,
                     block_bytes=block_size * LLAMA2_7B.bytes_per_token, block_size=block_size)


def assumptions(args) -> list[str]:
    return [
        "THIS IS A MODEL, NOT A MEASUREMENT: arithmetic on a recorded trace, no 7B model was run",
        f"KV shaped like LLaMA-2-7B: {LLAMA2_7B.num_layers} layers, {LLAMA2_7B.num_kv_heads} KV heads, head dim "
        f"{LLAMA2_7B.head_dim}, fp16: {LLAMA2_7B.bytes_per_token} bytes a token, {args.block_size}-token blocks",
        f"weights: {LLAMA2_7B_PARAMETERS / 1e9:.2f} B parameters in fp16, resident on the device, read once per "
        f"forward pass (per group and token); 2 FLOPs a parameter a token; attention 4 x layers x heads x head dim "
        f"FLOPs per context token",
        f"device (RTX 4090 class): {args.link_gbps:g} GB/s host-to-device and the same back (full duplex), "
        f"{args.memory_tbps:g} TB/s device memory, {args.tflops:g} TFLOP/s; a forward pass takes its roofline "
        f"time, max(FLOPs / peak, bytes / bandwidth) (scheduler.roofline)",
        f"compute-tier KV budget {args.budget_gb:g} GB (24 GB less the weights and working memory); the host tier "
        f"holds everything else",
        "token (the layer-wise baseline): every path decodes each token together; the layers that do not fit are "
        "reloaded for every token (Eq. 1-2), each path's KV its own; loads overlap compute layer by layer, so a "
        "token takes max(compute, transfer)",
        "lbs: the engine's grouping code on the recorded trace; a group loads its non-resident blocks before it "
        "starts (stall), prefetches the next group's into its headroom while it computes (overlapped), and "
        "leaves its blocks resident (LRU); no prefetch across steps (the next step's groups depend on scores)",
        "decode only: prefill, verification and selection are excluded (the same under every policy)",
    ]


def simulate(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="ponder-simulate-") as workdir:
        loaded = served.load(args.model) if args.model else served.tiny_random(Path(workdir) / "model", layers=2)
        device = Device(DevicePeaks(flops=args.tflops * 1e12, bandwidth=args.memory_tbps * 1e12),
                        link_bandwidth=args.link_gbps * 1e9)
        cost = llama2_7b_cost(args.block_size)
        budget_bytes = int(args.budget_gb * 1e9)
        budget_blocks = budget_bytes // cost.block_bytes
        rows = {}
        for step_tokens in args.steps_of:
            trace, run = record_trace(loaded, paths=args.paths, width=args.width, prompt=args.prompt,
                                      generated=args.generated, step_tokens=step_tokens, block_size=args.block_size,
                                      seed=args.seed)
            token = replay_token(trace, LLAMA2_7B, cost, device, budget_bytes)
            outcomes = [token] + [replay_lbs(trace, LLAMA2_7B, cost, device, budget_blocks, args.block_size,
                                             share_prefix=share, max_beams=args.paths) for share in (False, True)]
            distinct = len({k for s in trace for p in s.paths for k in p.blocks_after})
            rows[str(step_tokens)] = {
                "steps": len(trace), "trace_seconds": round(run.seconds, 2), "distinct_blocks": distinct,
                "eq3_token_bytes": layerwise_request_bytes(LLAMA2_7B, args.paths, args.prompt, args.generated,
                                                           budget_bytes),
                "eq5_beam_bytes": beam_request_bytes(LLAMA2_7B, args.paths, args.prompt, args.generated, step_tokens),
                "policies": {o.policy: {"bytes_in": o.bytes_in, "bytes_out": o.bytes_out, "seconds": round(o.seconds, 3),
                                        "stall_share": round(o.stall_share, 4), "groups": o.num_groups,
                                        "bytes_vs_token": o.bytes_in / token.bytes_in if token.bytes_in else None,
                                        "speedup_vs_token": round(token.seconds / o.seconds, 3)}
                             for o in outcomes},
            }
    return {"kind": "model, not a measurement", "trace_model": loaded.name, "paths": args.paths,
            "beam_width": args.width, "prompt_tokens": args.prompt, "generated_tokens": args.generated,
            "block_size": args.block_size, "budget_blocks": budget_blocks, "assumptions": assumptions(args),
            "steps_of": rows}


def table(r: dict) -> str:
    gb = 1e9
    rows = [f"MODELLED (not measured): LLaMA-2-7B KV, {r['paths']} paths (width {r['beam_width']}), prompt "
            f"{r['prompt_tokens']}, {r['generated_tokens']} tokens generated; trace recorded on the served engine "
            f"with {r['trace_model']}", "assumptions:"]
    rows += [f"  - {a}" for a in r["assumptions"]]
    body = []
    for step, s in r["steps_of"].items():
        for name, p in s["policies"].items():
            share = "-" if p["bytes_vs_token"] is None else f"{p['bytes_vs_token']:.2%}"
            body.append([f"{step}", name, f"{p['bytes_in'] / gb:,.0f}", share, f"{p['seconds']:,.1f}",
                         f"{p['speedup_vs_token']:.2f}x", f"{p['stall_share']:.0%}", p["groups"]])
    rows += columns(["step tokens", "policy", "GB to device", "vs token", "model s", "speedup", "stall", "groups"],
                    body, first_width=11)
    rows.append("paper's Eq. 3 / Eq. 5 for the same shape (GB): " + ", ".join(
        f"step {k}: {s['eq3_token_bytes'] / gb:,.0f} / {s['eq5_beam_bytes'] / gb:,.0f}" for k, s in r["steps_of"].items()))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 paths, 256 tokens, steps of 32 and 64, a 1 GB budget")
    parser.add_argument("--model", default=None, help="record the trace on this model (default: a random llama)")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--paths", type=int, default=64)
    parser.add_argument("--width", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--generated", type=int, default=1920, help="tokens generated per path (the paper's 1920)")
    parser.add_argument("--steps-of", type=int, nargs="+", default=[32, 64, 128], help="step lengths in tokens")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-gb", type=float, default=7.0, help="compute-tier KV budget (the paper's 7 GB)")
    parser.add_argument("--link-gbps", type=float, default=25.0, help="host-to-device GB/s")
    parser.add_argument("--memory-tbps", type=float, default=DESKTOP_MEMORY_TBPS, help="device memory TB/s")
    parser.add_argument("--tflops", type=float, default=DESKTOP_TFLOPS, help="fp16 TFLOP/s")
    args = parser.parse_args(argv)
    if args.quick:
        args.paths, args.generated, args.steps_of, args.budget_gb = 16, 256, [32, 64], 1.0
    results = simulate(args)
    emit(results, table(results), args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
