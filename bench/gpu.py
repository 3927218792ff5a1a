"""The device check for a CUDA GPU: one script, one JSON naming the GPU beside its figures.

    python -m bench.gpu [--out PATH] [--steps N] [--skip-tests] [--no-8b]      (make gpu-check)

Runs, in order, and records each step's result or its error (a step that breaks is named in `errors`
and the exit status is 1; nothing is skipped silently):

1. `make test-gpu`'s tests (marked `cuda`), with this interpreter;
2. the start-up probe (runtime.model.row_padding) on the embedded model in bfloat16: does the GPU keep
   batch invariance (the Triton decode kernel attends each query alone, so only torch's linear layers
   are probed), and at which padded row counts;
3. the HBM read bandwidth measured here (a device-to-device copy), which sets each model's limit:
   bandwidth / bytes one decode step reads (weights, and every stream's KV);
4. decode tokens/s at 1 and 16 streams of the embedded model and of an 8B-shaped llama with random
   bfloat16 weights made on the GPU (nothing downloaded), through ponder's model runner with its
   Triton kernels, CUDA graphs on (and row padding: batch invariance on), and the embedded model's
   eager figures with invariance off beside them (the cost of invariance and graphs together);
5. graph replay against eager: the same decode steps' logits, bit for bit;
6. the 8B-shaped model from random 4-bit blocks (Q4_K's form: codes, d and m per 32 inputs) through the
   Triton block GEMM (runtime.model.gpu_blocks), against the limit at the file's 4.5 bits a weight.

Greedy decoding from the runner's logits, timed after the prompt's step; no sampler, no server.
Not built yet (said in the JSON): the loader keeping a GGUF's blocks on a GPU, and the seeds' own
figures (LBS, HeadInfer, FlashTTS).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

EIGHT_B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
PROMPT_TOKENS = 64
STREAMS = (1, 16)
NOT_BUILT = ["a GGUF's blocks kept on the GPU by the loader (quantize = auto still dequantizes there; the "
             "4-bit figures here are random blocks, two codes a byte, float32 scales)",
             "LBS against token-wise offload under one KV budget", "HeadInfer at ten times the GPU's KV budget",
             "FlashTTS: the search example's goodput with speculation on and off"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON's path (default: bench/results/gpu-<device>.json)")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per figure")
    parser.add_argument("--skip-tests", action="store_true", help="leave out `make test-gpu`")
    parser.add_argument("--no-8b", action="store_true", help="leave out the 8B-shaped model")
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
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / best


def random_8b(device: torch.device):
    """An 8B-shaped llama (Llama-3-8B's shapes) with random bfloat16 weights made on the device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**EIGHT_B)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    return model.eval()


def embedded_model(device: torch.device):
    from runtime.model import attention
    from runtime.model.cached_model import load_quantized_model
    from runtime.model.loader import resolve_model

    model, _ = load_quantized_model(resolve_model(None), device, torch.bfloat16, attention.register(), "auto", False)
    return model


def make_runner(model, invariant: bool, graphs: bool, max_rows: int = 16, context: int = 1024):
    """A model runner on the model's device with room for `max_rows` streams of `context` tokens."""
    from runtime.model.model_runner import ModelRunner
    from runtime.model.row_padding import padding_for
    from storage.kv_cache import KVCache, kv_shape_of

    device = next(model.parameters()).device
    shape = kv_shape_of(model.config, 16)
    blocks = max_rows * -(-context // 16) + 1
    padding = padding_for(model, True, 64, 64, max_model_len=context, block_size=16) if invariant else None
    cache = KVCache(shape, blocks, next(model.parameters()).dtype, device, scratch=padding is not None)
    runner = ModelRunner(model, cache, padding)
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
    torch.cuda.empty_cache()
    return file_bytes


def q4_figures(steps: int, bandwidth: float, report: dict) -> None:
    """The 8B-shaped model from 4-bit blocks: its limit at the file's 4.5 bits a weight (the issue's
    mark), and at the bytes the kernel reads (two codes a byte, float32 scales) beside it."""
    from bench.decode import step_weight_bytes
    from runtime.model.gpu_blocks import GpuBlockLinear

    model = random_8b(torch.device("cuda"))
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
    torch.cuda.empty_cache()


def step(report: dict, name: str, fn) -> None:
    """Run one step of the check; record its error (with the traceback's last line) rather than stop."""
    started = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - every failure is reported, then the exit status is 1
        report["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    report["seconds"][name] = round(time.perf_counter() - started, 1)


def run(args: argparse.Namespace) -> dict:
    import triton

    if not torch.cuda.is_available():
        raise SystemExit(f"python -m bench.gpu: torch {torch.__version__} sees no CUDA device")
    device = torch.device("cuda")
    report: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                    "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "errors": [], "seconds": {},
                    "not_built": NOT_BUILT}

    def tests() -> None:
        # `make test-gpu`'s command, with this interpreter (a GPU machine's torch may be outside .venv)
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda"], capture_output=True, text=True)
        report["test_gpu"] = {"status": result.returncode, "tail": result.stdout[-2000:] + result.stderr[-2000:]}
        if result.returncode:
            raise RuntimeError(f"pytest -m cuda exited with {result.returncode}")

    if not args.skip_tests:
        step(report, "test_gpu", tests)
    model = embedded_model(device)

    def probe() -> None:
        from runtime.model.row_padding import padding_for

        padding = padding_for(model, True, 64, 64, max_model_len=2048, block_size=16)
        report["probe"] = {"accepted": True, "safe_counts": padding.safe_counts}

    step(report, "probe", probe)
    step(report, "bandwidth", lambda: report.__setitem__("bandwidth_gbs", round(device_bandwidth(device) / 1e9, 1)))
    bandwidth = report.get("bandwidth_gbs", 0) * 1e9 or 1.0
    step(report, "embedded", lambda: figures("embedded", model, args.steps, bandwidth, report))

    def invariance_off() -> None:
        runner = make_runner(model, invariant=False, graphs=False)
        entry = report["models"]["embedded"]
        for streams in STREAMS:
            off = decode(runner, streams, args.steps)["tokens_per_s"]
            entry[f"streams_{streams}"]["invariance_off_eager_tokens_per_s"] = round(off, 1)

    step(report, "invariance_off", invariance_off)
    del model
    torch.cuda.empty_cache()
    if not args.no_8b:
        step(report, "llama_8b_bf16", lambda: figures("llama_8b_bf16", random_8b(device), args.steps, bandwidth, report))
        gc.collect()
        torch.cuda.empty_cache()
        step(report, "llama_8b_q4_blocks", lambda: q4_figures(args.steps, bandwidth, report))
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    path = output_path(report["device"], args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "test_gpu"}, indent=2))
    print(f"written to {path}", file=sys.stderr)
    if report["errors"]:
        print("FAILED: " + "; ".join(report["errors"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
