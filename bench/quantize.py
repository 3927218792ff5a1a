"""Quantized weights: decode speed and perplexity of each `[model] quantize` mode, same model, same run.

    ponder bench quantize [--model PATH] [--modes auto,none,int8,int4] [--tokens N] [--parallel N] [--json PATH]

For every mode the engine is built as `ponder serve --quantize MODE` builds it, then decodes one
greedy stream and N parallel sampled sequences (tokens/s after a warm-up), and the model's perplexity
is measured on tests/data/declaration.txt (the US Declaration of Independence, public domain),
scored in one forward pass.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.report import emit
from runtime.model import attention
from runtime.bootstrap import build_engine
from runtime.wire.params import SamplingParams
from runtime.wire.protocol import GenerateRequest
from runtime.wire.options import RuntimeOptions
from runtime.model.quantize_setting import QUANTIZE_MODES

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "declaration.txt"
PROMPT = "The history of the present King of Great Britain is"


def decode_tokens_per_s(engine, prompt_ids: list[int], n: int, tokens: int) -> float:
    sampling = SamplingParams(max_tokens=tokens, temperature=0.0 if n == 1 else 0.8, n=n, seed=0, ignore_eos=True)
    engine.add_request(GenerateRequest(request_id=f"quantize-{n}-{time.monotonic_ns()}", endpoint="completion",
                                       prompt_token_ids=tuple(prompt_ids), sampling=sampling))
    engine.step()  # prefill and every sequence's first token
    start, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    return steps * n / (time.perf_counter() - start)


@torch.inference_mode()
def perplexity(model, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood of each token given the ones before it), in one pass."""
    ids = torch.tensor([token_ids], device=next(model.parameters()).device)
    model.set_attn_implementation("sdpa")
    try:
        logits = model(ids).logits[0, :-1].float()
    finally:
        model.set_attn_implementation(attention.ATTENTION_NAME)
    return math.exp(F.cross_entropy(logits, ids[0, 1:]).item())


def run(model: str | None, modes: list[str], tokens: int, parallel: int) -> dict:
    results: dict = {"text": TEXT.name, "threads": torch.get_num_threads(), "new_tokens": tokens,
                     "parallel": parallel, "modes": []}
    for mode in modes:
        torch.manual_seed(0)
        engine, source = build_engine(RuntimeOptions(model=model, device="cpu", quantize=mode,
                                                     max_num_seqs=max(64, parallel)))
        text_ids = engine.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
        prompt_ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
        decode_tokens_per_s(engine, prompt_ids, 1, 8)  # warm-up
        results["model"] = source.name
        results["text_tokens"] = len(text_ids)
        results["modes"].append({
            "quantize": mode,
            "weight_bytes": _weight_bytes(engine.model),
            "tokens_per_s_1": round(decode_tokens_per_s(engine, prompt_ids, 1, tokens), 1),
            f"tokens_per_s_{parallel}": round(decode_tokens_per_s(engine, prompt_ids, parallel, tokens), 1),
            "perplexity": round(perplexity(engine.model, text_ids), 3)})
        engine.close()
    return results


def _weight_bytes(model) -> int:
    """Bytes of the parameters and buffers a forward pass reads (a tied head counted once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def table(results: dict) -> str:
    p = results["parallel"]
    rows = [f"quantized decode: {results['model']}, {results['threads']} threads, {results['new_tokens']} new tokens; "
            f"perplexity on {results['text']} ({results['text_tokens']} tokens)",
            f"{'quantize':<9} {'weights MiB':>12} {'tok/s 1 row':>12} {f'tok/s {p} rows':>14} {'perplexity':>11}"]
    for m in results["modes"]:
        rows.append(f"{m['quantize']:<9} {m['weight_bytes'] / 2**20:>12.1f} {m['tokens_per_s_1']:>12.1f} "
                    f"{m[f'tokens_per_s_{p}']:>14.1f} {m['perplexity']:>11.3f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench quantize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--modes", default=",".join(QUANTIZE_MODES),
                        help="comma-separated quantize modes (default: all)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in QUANTIZE_MODES]
    if unknown:
        parser.error(f"--modes: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(QUANTIZE_MODES)}")
    results = run(args.model, modes, args.tokens, args.parallel)
    emit(results, table(results), args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
