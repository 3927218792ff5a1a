"""The search example of docs/benchmarks.md, timed in-process on the engine `ponder serve` builds.

    ponder bench example [--model PATH] [--quick] [--deterministic] [--verifier NAME] [--max-tokens N]
                         [--speculative-extension {true,false,auto,both}] [--json PATH]

The request is the one docs/benchmarks.md times ("search at the engine's speed"): a chat completion
with a beam search (n 16, beam width 4, the `judge` verifier), `max_tokens` 512, OpenAI `n` 2, seed 42,
temperature 0.8.
It goes through the server's own request schema (so every default the server fills in is filled in
the same way) and runs on an engine built from the server's default settings, driven as the runtime
process drives it: `add_request`, then `step` until idle. The model load is not timed.

Reported: seconds, generated tokens, tok/s, the search's own split (seconds generating and
verifying, judge tokens prefilled), and what the engine's model steps were: decode steps (every
row one token) with their mean batch size and seconds, and prefill steps (prompt, judge questions)
with their tokens and seconds. Then the same engine decodes 16 sampled sequences of the example's
prompt as one plain request (`n` 16, 64 tokens; 8 with `--quick`), and the search's tokens per second
are given as a fraction of that rate: how close the search explores at the engine's own speed.
Beside the decode steps stand the two figures that bound them, independent of the device: the
search's longest path in tokens (a step lasts as long as its longest path, so no schedule takes
fewer steps) and the steps 16 plain streams take for as many tokens (tokens / 16). And what those
very steps would take a 7B model on a desktop GPU, A MODEL and not a measurement: each decode step
(its rows and the KV they attend to) priced by the roofline with LLaMA-2-7B's weights and KV in fp16
on `bench simulate`'s RTX 4090-class profile (165 TFLOP/s, 1 TB/s), where a step costs about the
weights' read whatever its rows, so decode steps, not rows, make a search's time.
`--speculative-extension` sets `[scheduler] speculative_extension` (default: the server's); `both`
runs the search with it off and on, on one engine each, and reports both.
`--verifier` and `--max-tokens` change the example's; `--quick` is a small search for a smoke run.
"""

from __future__ import annotations

import argparse
import hashlib

import torch

from bench.report import columns, emit, kernel_isa
from bench.search import searched
from bench.simulate import DESKTOP_MEMORY_TBPS, DESKTOP_TFLOPS, llama2_7b_cost
from bench.steps import LongestPath, StepLog, gpu_decode_seconds
from scheduler.roofline import DevicePeaks
from runtime.search.answers import warm_up
from runtime.bootstrap import build_engine
from runtime.wire.protocol import Delta, GenerateRequest
from server.config import Settings
from server.schemas import ChatCompletionRequest

MESSAGES = [
    {"role": "system", "content": "Solve step by step, steps separated by blank lines, end with "
                                  "`Therefore, the final answer is: $\\boxed{answer}$.`"},
    {"role": "user", "content": "What is 17 * 3?"},
]
EXAMPLE = {"temperature": 0.8, "seed": 42, "max_tokens": 512, "n": 2,
           "search": {"strategy": "beam", "n": 16, "beam_width": 4, "verifier": "judge",
                      "select": "weighted_majority"}}
QUICK = {"temperature": 0.8, "seed": 42, "max_tokens": 24, "n": 2,
         "search": {"strategy": "beam", "n": 4, "beam_width": 2, "verifier": "judge", "max_step_tokens": 6,
                    "select": "weighted_majority"}}


def example_request(body: dict, settings: Settings, request_id: str) -> GenerateRequest:
    """The runtime request the server makes of this chat completion body."""
    chat = ChatCompletionRequest(model=None, messages=MESSAGES, **body)
    return GenerateRequest(request_id=request_id, endpoint="chat", messages=chat.wire_messages(),
                           sampling=chat.to_sampling(),
                           search=chat.search.to_params(False, settings.search.max_timeout_s))


def run(model: str | None, quick: bool, deterministic: bool = False, verifier: str | None = None,
        max_tokens: int | None = None, speculative: bool | str | None = None, device: str | None = None) -> dict:
    scheduler = {"batch_invariant": deterministic or None}
    if speculative is not None:
        scheduler["speculative_extension"] = speculative
    settings = Settings.load(None, model={"path": model, "device": device}, scheduler=scheduler)
    engine, source = build_engine(settings.runtime_options())
    steps = StepLog(engine.runner)
    longest = LongestPath(engine)
    body = dict(QUICK if quick else EXAMPLE)
    body["search"] = {**body["search"], **({"verifier": verifier} if verifier else {})}
    body["max_tokens"] = max_tokens or body["max_tokens"]
    request = example_request(body, settings, "bench-example")
    warm_up()  # as the runtime process does once it is ready
    messages, finished, seconds = searched(engine, request)
    summary = finished.search
    spec = engine.stats["speculative_tokens"]
    model_steps = steps.summary()
    engine.runner.execute = steps.execute  # the plain rate runs unobserved
    plain = plain_rate(engine, request, 8 if quick else 64)
    return {"model": source.name, "device": str(engine.device), "quantize": engine.quantized.mode,
            "threads": torch.get_num_threads(), "isa": kernel_isa(),
            "deterministic": engine.padding is not None,
            "request": body, "seconds": round(seconds, 2),
            "tokens_generated": summary.tokens_generated,
            "tok_s": round(summary.tokens_generated / seconds, 1),
            "plain_16_tok_s": round(plain, 1),
            "vs_plain_16": round(summary.tokens_generated / seconds / plain, 2),
            "seconds_generating": round(summary.seconds_generating, 2),
            "seconds_verifying": round(summary.seconds_verifying, 2),
            "verifier_tokens_prefilled": summary.verifier_tokens_prefilled,
            "verifier_calls": summary.verifier_calls, "steps": summary.steps,
            "paths_explored": summary.paths_explored, "prefix_hit_tokens": summary.prefix_hit_tokens,
            "speculative_extension": engine.config.speculative_extension,
            "speculative_tokens_used": spec.get("used", 0), "speculative_tokens_discarded": spec.get("discarded", 0),
            "speculative_tokens_adopted": spec.get("adopted", 0),
            "output_digest": output_digest(messages), "longest_path_tokens": longest.tokens, "plain_16_steps": -(-summary.tokens_generated // 16),
            **model_steps,
            "gpu_7b_decode_seconds": round(gpu_decode_seconds(steps, llama2_7b_cost(16), GPU), 2),
            "steps_per_longest_path": round(model_steps["decode_steps"] / max(1, longest.tokens), 2)}


# bench simulate's desktop-GPU profile, for the decode steps' model time
GPU = DevicePeaks(flops=DESKTOP_TFLOPS * 1e12, bandwidth=DESKTOP_MEMORY_TBPS * 1e12)


def output_digest(messages) -> str:
    """A short digest of every returned choice's token ids and score: equal digests, the same answers."""
    chosen = [(m.index, m.token_ids, m.search.score if m.search else None) for m in messages
              if isinstance(m, Delta) and m.token_ids]
    return hashlib.sha256(repr(sorted(chosen)).encode()).hexdigest()[:16]


def plain_rate(engine, request: GenerateRequest, tokens: int) -> float:
    """The engine's tokens/s for 16 sampled sequences of `request`'s prompt (one plain request, n 16),
    the best of two runs after a warm-up."""
    from bench.decode import best_of, chat_prompt_ids, engine_tokens_per_s

    ids = chat_prompt_ids(engine.tokenizer, request.messages)
    engine_tokens_per_s(engine, ids, 16, 4)
    return best_of(2, lambda: engine_tokens_per_s(engine, ids, 16, tokens))["tokens_per_s"]


def table(r: dict) -> str:
    search = r["request"]["search"]
    mode = ", deterministic" if r["deterministic"] else ""
    where = (f"{r['threads']} threads, {r['isa']} kernel" if r.get("device", "cpu") == "cpu"
             else f"on {r['device']}")
    head = (f"search example: {r['model']} ({r['quantize']}{mode}), {where}, {search['strategy']} "
            f"n={search['n']} width={search['beam_width']}, {search['verifier']}, max_tokens "
            f"{r['request']['max_tokens']}, seed {r['request']['seed']}")
    rows = [["seconds", r["seconds"]], ["generated tokens", r["tokens_generated"]], ["tok/s", r["tok_s"]],
            ["plain n=16 tok/s (same engine)", r["plain_16_tok_s"]],
            ["search tok/s / plain n=16", f"{r['vs_plain_16']:.2f}x"],
            ["s generating", r["seconds_generating"]], ["s verifying", r["seconds_verifying"]],
            ["judge tokens prefilled", r["verifier_tokens_prefilled"]],
            ["search steps", r["steps"]], ["paths explored", r["paths_explored"]],
            ["speculative extension", r["speculative_extension"]],
            ["speculative tokens used / adopted / discarded",
             f"{r['speculative_tokens_used']} / {r['speculative_tokens_adopted']} / {r['speculative_tokens_discarded']}"],
            ["decode steps (mean batch)", f"{r['decode_steps']} ({r['decode_mean_batch']})"],
            ["longest path tokens / plain n=16 steps", f"{r['longest_path_tokens']} / {r['plain_16_steps']}"],
            ["decode steps / longest path", f"{r['steps_per_longest_path']:.2f}x"],
            ["s in decode steps", r["decode_seconds"]],
            ["the same steps, a 7B on an RTX 4090-class GPU (a model)", f"{r['gpu_7b_decode_seconds']:.2f} s"],
            ["prefill steps (tokens)", f"{r['prefill_steps']} ({r['prefill_tokens']})"],
            ["s in prefill steps", r["prefill_seconds"]]]
    return "\n".join([head, *columns(["", "value"], rows, first_width=36)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench example", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--quick", action="store_true", help="a 4-path search of at most 24 tokens")
    parser.add_argument("--deterministic", action="store_true",
                        help="as `ponder serve --deterministic`: the same tokens however the engine batches them, "
                             "so two versions of the engine can be compared on the very same search")
    parser.add_argument("--verifier", default=None, help="the search's verifier (default: the example's, judge)")
    parser.add_argument("--max-tokens", type=int, default=None, help="the search's max_tokens (default: the example's)")
    parser.add_argument("--speculative-extension", choices=["true", "false", "auto", "both"], default=None,
                        help="[scheduler] speculative_extension for this run (both: off, then on)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None,
                        help="[model] device for this run (default: the server's, auto)")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    settings = {"true": [True], "false": [False], "auto": ["auto"], "both": [False, True], None: [None]}
    runs = [run(args.model, args.quick, args.deterministic, args.verifier, args.max_tokens, speculative, args.device)
            for speculative in settings[args.speculative_extension]]
    results = runs[0] if len(runs) == 1 else {"speculation_off": runs[0], "speculation_on": runs[1]}
    emit(results, "\n\n".join(table(r) for r in runs), args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
