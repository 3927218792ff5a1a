"""Decode throughput side by side: ponder's modes, transformers and llama.cpp, same model, same run.

    ponder bench decode [--model PATH] [--tokens N] [--parallel N] [--systems LIST] [--repeats N]
                        [--prefill 512,2048] [--profile] [--json PATH] [--plot PATH]

Every system decodes from the same prompt token ids: one greedy stream, and N sampled sequences
(one request, n=N, sharing the prompt's blocks; one batch of N for transformers), timed after the
first token (which carries the prefill) and after a warm-up. Each figure is the best of `--repeats`
runs (default 3), for every system alike: on a shared machine a whole run can be slowed by its
neighbours, and the best run is the one closest to what the system can do. Systems:

- `default`: ponder with default settings (`quantize = "auto"`: on a CPU, a GGUF's own quantized blocks;
  `batch_invariant = "auto"`: batch-invariant wherever the device can be)
- `not-invariant`: the same with `--no-deterministic` (the opt-out: results may depend on the batch)
- `float32`, `int8`, `int4`: ponder with `--quantize none|int8|int4` (int4 re-quantizes the floats)
- `transformers`: transformers' `generate` on the float32 model (eager PyTorch, SDPA attention)
- `llama.cpp`: llama-cpp-python on the same GGUF file, one stream (skipped, with the reason, when the
  package is missing or the model is not a GGUF)

Each figure is printed as a ratio to transformers, and as a fraction of the memory-bandwidth limit:
weight bytes read per step x steps/s / the read bandwidth measured here (a sum over a 512 MiB tensor).
Prefill (`--prefill`, default 512 and 2048 tokens; `--prefill ""` skips it), for `default` and
`not-invariant`: seconds to compute a prompt of that many random token ids and its first token, cold
(nothing cached) and half cached (a prompt sharing its first half computed just before), as prompt
tokens per second, the best of `--repeats`, each time on new ids. With --profile, the default system's
decode steps also run under torch.profiler.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench import llama_cpp
from bench.report import emit, kernel_isa, plot_path
from runtime.model import attention
from runtime.bootstrap import build_engine
from runtime.model.loader import load_causal_lm, resolve_model
from runtime.wire.params import SamplingParams
from runtime.wire.protocol import GenerateRequest
from runtime.wire.options import RuntimeOptions

PROMPT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
PONDER = {"default": {}, "not-invariant": {"batch_invariant": False}, "float32": {"quantize": "none"},
          "int8": {"quantize": "int8"}, "int4": {"quantize": "int4"}}
PREFILL_SYSTEMS = ("default", "not-invariant")
SYSTEMS = (*PONDER, "transformers", "llama.cpp")
OUT_DIR = Path(__file__).resolve().parent / "out"


def _request(prompt_ids: list[int], n: int, tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id=f"bench-{n}-{time.monotonic_ns()}", endpoint="completion",
                           prompt_token_ids=tuple(prompt_ids),
                           sampling=SamplingParams(max_tokens=tokens, temperature=0.0 if n == 1 else 0.8, n=n,
                                                   seed=0, ignore_eos=True))


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    """The token ids a chat request's `messages` become: the chat template, no added special tokens."""
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def engine_tokens_per_s(engine, prompt_ids: list[int], n: int, tokens: int) -> dict:
    engine.add_request(_request(prompt_ids, n, tokens))
    engine.step()  # prefill and the first token of every sequence
    start, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    return {"tokens": steps * n, "seconds": seconds, "tokens_per_s": steps * n / seconds}


def prefill_tokens_per_s(engine, num_tokens: int, cached: bool, generator: torch.Generator) -> dict:
    """Seconds to compute a new prompt of `num_tokens` random ids and its first token; `cached`: its
    first half was computed (as another prompt's) just before, and is found in the prefix cache."""
    low = 1000 if engine.vocab_size > 2000 else 1  # clear of a real vocabulary's special tokens
    ids = torch.randint(low, min(engine.vocab_size, 40000), (num_tokens,), generator=generator).tolist()
    if cached:
        _one_token(engine, ids[:num_tokens // 2] + [7] * 8)
    seconds = _timed(lambda: _one_token(engine, ids))
    computed = num_tokens - (num_tokens // 2 // engine.config.block_size * engine.config.block_size if cached else 0)
    return {"seconds": seconds, "tokens_computed": computed, "tokens_per_s": computed / seconds}


def _one_token(engine, ids: list[int]) -> None:
    engine.add_request(_request(ids, 1, 1))
    while engine.has_work:
        engine.step()


def best_of(repeats: int, measure) -> dict:
    """The fastest of `repeats` calls of `measure()` (each returns a dict with `tokens_per_s`)."""
    return max((measure() for _ in range(max(1, repeats))), key=lambda r: r["tokens_per_s"])


def profile_table(engine, prompt_ids: list[int], n: int, tokens: int, rows: int = 25) -> str:
    """The engine's decode steps for one case under torch.profiler: operators by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    engine.add_request(_request(prompt_ids, n, tokens))
    engine.step()  # prefill: not profiled
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        while engine.has_work:
            engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


@torch.inference_mode()
def hf_tokens_per_s(model, prompt_ids: list[int], n: int, tokens: int) -> dict:
    ids = torch.tensor([prompt_ids] * n, device=model.device)
    kwargs = dict(do_sample=n > 1, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)
    if n > 1:
        kwargs["temperature"] = 0.8
    one = {**kwargs, "max_new_tokens": 1, "min_new_tokens": 1}
    model.generate(ids, **one)  # warm-up
    start = time.perf_counter()
    model.generate(ids, **kwargs)
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(ids, **one)  # the prefill and first token, subtracted so both sides time decode only
    decode = max(seconds - (time.perf_counter() - start), 1e-9)
    produced = (tokens - 1) * n
    return {"tokens": produced, "seconds": decode, "tokens_per_s": produced / decode}


def step_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer once, but the input
    embedding only when it is also the head (otherwise a step reads a few of its rows)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    lookup = model.get_input_embeddings()
    head = getattr(model.get_output_embeddings(), "weight", None)
    # a float table (`weight`), a GGUF's blocks (`blocks`), or none of its own (the tied head's rows)
    embedding = getattr(lookup, "weight", getattr(lookup, "blocks", None))
    if embedding is not None and head is not embedding:
        tensors.pop(id(embedding), None)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes/s a sum over a `mib` MiB float32 tensor reads, the best of `repeats`."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(model: str | None, tokens: int, parallel: int, systems: list[str], profile: bool = False,
        repeats: int = 3, prefill: tuple[int, ...] = (512, 2048), cpu_isa: str = "auto", device: str = "cpu") -> dict:
    threads = torch.get_num_threads()
    results: dict = {"device": device, "threads": threads, "new_tokens": tokens, "parallel": parallel,
                     "read_bandwidth_gbs": round(read_bandwidth() / 1e9, 2), "systems": []}
    source = resolve_model(model)
    results["model"] = source.name
    prompt_ids: list[int] | None = None
    for name in [s for s in systems if s in PONDER]:
        torch.manual_seed(0)
        engine, _ = build_engine(RuntimeOptions(model=model, device=device, max_num_seqs=max(64, parallel),
                                                cpu_isa=cpu_isa, **PONDER[name]))
        results["isa"] = kernel_isa()
        if prompt_ids is None:
            prompt_ids = chat_prompt_ids(engine.tokenizer, PROMPT)
        engine_tokens_per_s(engine, prompt_ids, 1, 8)  # warm-up
        entry = {"system": name, "setting": engine.quantized.describe(), "weight_bytes": step_weight_bytes(engine.model),
                 **{f"tokens_per_s_{key}": best_of(repeats, lambda n=n: engine_tokens_per_s(engine, prompt_ids, n, tokens))
                    ["tokens_per_s"] for key, n in (("1", 1), ("n", parallel))}}
        if name in PREFILL_SYSTEMS and prefill:
            generator = torch.Generator().manual_seed(0)
            entry["prefill"] = {f"{n}_{'half_cached' if cached else 'cold'}": round(best_of(
                repeats, lambda n=n, cached=cached: prefill_tokens_per_s(engine, n, cached, generator))["tokens_per_s"], 1)
                for n in prefill for cached in (False, True)}
        entry["invariant"] = engine.padding is not None
        if profile and name == "default":
            for n in (1, parallel):
                print(f"-- default, {n} sequence(s): decode steps by self CPU time\n"
                      + profile_table(engine, prompt_ids, n, tokens))
        results["systems"].append(entry)
        engine.close()
    if "transformers" in systems:
        hf_device = torch.device(device)
        hf_dtype = torch.float32 if device == "cpu" else torch.bfloat16
        hf = load_causal_lm(source, hf_device, hf_dtype, "sdpa")
        if prompt_ids is None:
            from runtime.model.loader import load_tokenizer

            prompt_ids = chat_prompt_ids(load_tokenizer(source), PROMPT)
        results["systems"].append({"system": "transformers", "setting": f"generate, {str(hf_dtype).removeprefix('torch.')}, eager, sdpa",
                                   "weight_bytes": step_weight_bytes(hf),
                                   **{f"tokens_per_s_{key}": best_of(repeats, lambda n=n: hf_tokens_per_s(
                                       hf, prompt_ids, n, tokens))["tokens_per_s"] for key, n in (("1", 1), ("n", parallel))}})
        del hf
    if "llama.cpp" in systems:
        reason = ("the model is not a GGUF file" if not source.gguf_file else None) or llama_cpp.unavailable()
        if reason is None and prompt_ids is not None:
            path = f"{source.directory}/{source.gguf_file}"
            figure = llama_cpp.tokens_per_s(path, prompt_ids, tokens, threads, repeats)
            results["systems"].append({"system": "llama.cpp", "setting": f"llama-cpp-python, {source.gguf_file}",
                                       "weight_bytes": llama_cpp.weight_bytes(path),
                                       "tokens_per_s_1": figure["tokens_per_s"], "tokens_per_s_n": None,
                                       "note_n": "the Llama API decodes one sequence at a time"})
        else:
            results["llama_cpp_skipped"] = reason or "no prompt ids (run it with another system)"
    _derive(results)
    return results


def _derive(results: dict) -> None:
    """Ratios to transformers and fractions of the bandwidth limit, rounded figures."""
    bandwidth = results["read_bandwidth_gbs"] * 1e9
    base = next((s for s in results["systems"] if s["system"] == "transformers"), None)
    for s in results["systems"]:
        for key, rows in (("1", 1), ("n", results["parallel"])):
            rate = s[f"tokens_per_s_{key}"]
            if rate is None:
                continue
            # three significant digits: a tiny model's fraction is far below a thousandth
            s[f"bandwidth_fraction_{key}"] = float(f"{s['weight_bytes'] * rate / rows / bandwidth:.3g}")
            if base is not None:
                s[f"vs_transformers_{key}"] = round(rate / base[f"tokens_per_s_{key}"], 2)
            s[f"tokens_per_s_{key}"] = round(rate, 1)


def table(results: dict) -> str:
    n = results["parallel"]
    where = "" if results.get("device", "cpu") == "cpu" else f"on {results['device']}, "
    rows = [f"decode: {results['model']}, {where}{results['threads']} threads, {results.get('isa', 'no ponder')} kernel, "
            f"{results['new_tokens']} new tokens per "
            f"sequence, read bandwidth {results['read_bandwidth_gbs']} GB/s",
            f"{'system':<14} {'weights MiB':>11} {'tok/s 1':>8} {'vs hf':>6} {'of bw':>6} "
            f"{f'tok/s {n}':>9} {'vs hf':>6} {'of bw':>6}"]

    def cell(s, key, width, fmt):
        value = s.get(key)
        return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"

    for s in results["systems"]:
        rows.append(f"{s['system']:<14} {s['weight_bytes'] / 2**20:>11.1f} "
                    + " ".join([cell(s, "tokens_per_s_1", 8, ".1f"), cell(s, "vs_transformers_1", 5, ".2f") + "x",
                                cell(s, "bandwidth_fraction_1", 6, ".0%"), cell(s, "tokens_per_s_n", 9, ".1f"),
                                cell(s, "vs_transformers_n", 5, ".2f") + "x", cell(s, "bandwidth_fraction_n", 6, ".0%")]))
    for s in results["systems"]:
        rows.append(f"  {s['system']}: {s['setting']}" + (f"; {n} streams: {s['note_n']}" if s.get("note_n") else ""))
    rows.extend(_prefill_rows(results))
    if results.get("llama_cpp_skipped"):
        rows.append(f"  llama.cpp skipped: {results['llama_cpp_skipped']}")
    return "\n".join(rows)


def _prefill_rows(results: dict) -> list[str]:
    """Prompt tokens/s per prefill case, and default's ratio to not-invariant's."""
    measured = {s["system"]: s["prefill"] for s in results["systems"] if s.get("prefill")}
    if not measured:
        return []
    cases = list(next(iter(measured.values())))
    rows = ["prefill, prompt tokens/s computed: " + "  ".join(f"{c:>16}" for c in cases)]
    for name, figures in measured.items():
        rows.append(f"  {name:<31} " + "  ".join(f"{figures[c]:>16.1f}" for c in cases))
    if len(measured) == 2:
        default, other = measured["default"], measured["not-invariant"]
        rows.append(f"  {'default / not-invariant':<31} " + "  ".join(f"{default[c] / other[c]:>15.2f}x" for c in cases))
        decode = {s["system"]: s for s in results["systems"] if s["system"] in measured}
        rows.append("decode, default / not-invariant: " + ", ".join(
            f"{label} {decode['default'][key] / decode['not-invariant'][key]:.2f}x"
            for key, label in (("tokens_per_s_1", "1 stream"), ("tokens_per_s_n", f"{results['parallel']} streams"))))
    return rows


def plot(results: dict, path: Path) -> str | None:
    """A bar chart of tokens/s per system at 1 and N streams; None, or why there is no plot."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (the `bench` extra): no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = results["systems"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.4
    for i, (key, label) in enumerate((("1", "1 stream"), ("n", f"{results['parallel']} streams"))):
        xs = [j + (i - 0.5) * width for j in range(len(systems))]
        values = [s.get(f"tokens_per_s_{key}") or 0 for s in systems]
        bars = ax.bar(xs, values, width, label=label)
        for bar, s in zip(bars, systems):
            ratio = s.get(f"vs_transformers_{key}")
            if ratio is not None:
                ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(systems)), [s["system"] for s in systems])
    ax.set_ylabel("tokens/s")
    ax.set_title(f"decode, {results['model']}, {results['threads']} threads (ratios to transformers)")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the best is kept (default 3)")
    parser.add_argument("--prefill", default="512,2048",
                        help="prompt lengths whose prefill is timed for default and not-invariant (\"\": none)")
    parser.add_argument("--profile", action="store_true",
                        help="also print a torch.profiler breakdown of the default system's decode steps")
    parser.add_argument("--cpu-isa", default="auto", choices=("auto", "avx2"),
                        help="ponder's int4 kernel: auto (AVX512-VNNI where present) or the AVX2 path (model.cpu_isa)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where ponder's engines and transformers run (cuda: transformers in bfloat16)")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--plot", dest="plot_path", default=None,
                        help="PNG path (default: next to --json, else bench/out/decode.png)")
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    prefill = tuple(int(n) for n in args.prefill.split(",") if n.strip())
    results = run(args.model, args.tokens, args.parallel, systems, args.profile, args.repeats, prefill,
                  args.cpu_isa, args.device)
    path = plot_path(args.plot_path, args.json_path, OUT_DIR / "decode.png")
    skipped = plot(results, path)
    results["plot"] = skipped or str(path)
    emit(results, table(results), args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
