"""Decode throughput: ponder's engine against transformers' `generate`, same model, same run.

    ponder bench decode [--model PATH] [--tokens N] [--parallel N] [--profile] [--json PATH]

Measures tokens/s for one greedy stream and for N parallel sampled sequences (one request, n=N, so
the sequences share the prompt's blocks), after a warm-up, on the default model unless --model is given.
With --profile, each case's decode steps are also run under torch.profiler and the operators that
take the most self CPU time are printed.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.report import emit
from runtime.bootstrap import build_engine
from runtime.protocol import GenerateRequest, RuntimeOptions, SamplingParams

PROMPT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


def _engine_tokens_per_s(engine, prompt_ids: list[int], n: int, tokens: int, temperature: float) -> dict:
    request = GenerateRequest(request_id=f"bench-{n}-{time.monotonic_ns()}", endpoint="completion",
                              prompt_token_ids=tuple(prompt_ids),
                              sampling=SamplingParams(max_tokens=tokens, temperature=temperature, n=n, seed=0,
                                                      ignore_eos=True))
    engine.add_request(request)
    engine.step()  # prefill and the first token of every sequence
    start = time.perf_counter()
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    return {"tokens": steps * n, "seconds": seconds, "tokens_per_s": steps * n / seconds}


def _profile_table(engine, prompt_ids: list[int], n: int, tokens: int, temperature: float, rows: int = 25) -> str:
    """The engine's decode steps for one case under torch.profiler: operators by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    request = GenerateRequest(request_id=f"profile-{n}-{time.monotonic_ns()}", endpoint="completion",
                              prompt_token_ids=tuple(prompt_ids),
                              sampling=SamplingParams(max_tokens=tokens, temperature=temperature, n=n, seed=0,
                                                      ignore_eos=True))
    engine.add_request(request)
    engine.step()  # prefill: not profiled
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_work:
            engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def _hf_tokens_per_s(model, prompt_ids: list[int], n: int, tokens: int, temperature: float) -> dict:
    ids = torch.tensor([prompt_ids] * n)
    kwargs = dict(do_sample=temperature > 0, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)
    if temperature > 0:
        kwargs["temperature"] = temperature
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "max_new_tokens": 1, "min_new_tokens": 1})  # prefill cost
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        seconds = time.perf_counter() - start
    # Subtract one prefill so both sides time decode only.
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, **{**kwargs, "max_new_tokens": 1, "min_new_tokens": 1})
        prefill = time.perf_counter() - t0
    decode = max(seconds - prefill, 1e-9)
    produced = (tokens - 1) * n
    return {"tokens": produced, "seconds": decode, "tokens_per_s": produced / decode}


def run(model: str | None, tokens: int, parallel: int, dtype: str = "auto", batch_invariant: bool = False,
        profile: bool = False) -> dict:
    torch.manual_seed(0)
    engine, source = build_engine(RuntimeOptions(model=model, device="cpu", dtype=dtype,
                                                 max_num_seqs=max(64, parallel), batch_invariant=batch_invariant))
    tokenizer = engine.tokenizer
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    # Warm-up (allocator, first-call overheads) on both sides.
    _engine_tokens_per_s(engine, prompt_ids, 1, 8, 0.0)
    results = {"model": source.name, "dtype": str(engine.cache.dtype).removeprefix("torch."),
               "threads": torch.get_num_threads(), "prompt_tokens": len(prompt_ids),
               "new_tokens": tokens, "cases": []}
    hf_model = engine.model
    hf_model.set_attn_implementation("sdpa")
    _hf_tokens_per_s(hf_model, prompt_ids, 1, 4, 0.0)
    for name, n, temperature in [("1 stream, greedy", 1, 0.0), (f"{parallel} sequences, sampled", parallel, 0.8)]:
        hf = _hf_tokens_per_s(hf_model, prompt_ids, n, tokens, temperature)
        from runtime import attention

        hf_model.set_attn_implementation(attention.ATTENTION_NAME)
        ours = _engine_tokens_per_s(engine, prompt_ids, n, tokens, temperature)
        if profile:
            print(f"-- {name}: decode steps by self CPU time\n" + _profile_table(engine, prompt_ids, n, tokens, temperature))
        hf_model.set_attn_implementation("sdpa")
        results["cases"].append({"case": name, "sequences": n, "ponder_tokens_per_s": round(ours["tokens_per_s"], 1),
                                 "transformers_tokens_per_s": round(hf["tokens_per_s"], 1),
                                 "speedup": round(ours["tokens_per_s"] / hf["tokens_per_s"], 2)})
    hf_model.set_attn_implementation(attention.ATTENTION_NAME)
    return results


def table(results: dict) -> str:
    rows = [f"decode benchmark: {results['model']} ({results['dtype']}), {results['threads']} threads, prompt {results['prompt_tokens']} "
            f"tokens, {results['new_tokens']} new tokens per sequence",
            f"{'case':<26} {'ponder tok/s':>13} {'transformers tok/s':>19} {'speedup':>8}"]
    for c in results["cases"]:
        rows.append(f"{c['case']:<26} {c['ponder_tokens_per_s']:>13.1f} {c['transformers_tokens_per_s']:>19.1f} "
                    f"{c['speedup']:>7.2f}x")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="weights and KV dtype for both sides (auto: float32 on CPU)")
    parser.add_argument("--deterministic", dest="batch_invariant", action="store_true",
                        help="pad steps to batch-invariant row counts, as `ponder serve --deterministic`")
    parser.add_argument("--profile", action="store_true",
                        help="also print a torch.profiler breakdown of each case's decode steps")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    results = run(args.model, args.tokens, args.parallel, args.dtype, args.batch_invariant, args.profile)
    emit(results, table(results), args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
