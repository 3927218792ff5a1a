"""The search example of docs/benchmarks.md, timed in-process on the engine `ponder serve` builds.

    ponder bench example [--model PATH] [--quick] [--deterministic] [--verifier NAME] [--max-tokens N]
                         [--json PATH]

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
`--verifier` and `--max-tokens` change the example's; `--quick` is a small search for a smoke run.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.report import columns, emit, kernel_isa
from bench.search import searched
from runtime.search.answers import warm_up
from runtime.bootstrap import build_engine
from runtime.wire.protocol import GenerateRequest
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


class StepLog:
    """Wraps the engine's runner: the shape and seconds of every model step it executes."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.execute = runner.execute
        self.decode: list[tuple[int, float]] = []  # (rows, seconds) of steps whose rows are one token each
        self.prefill: list[tuple[int, float]] = []  # (tokens, seconds) of the other steps
        runner.execute = self

    def __call__(self, scheduled, copies, sampled, *rest):
        started = time.perf_counter()
        logits = self.execute(scheduled, copies, sampled, *rest)
        seconds = time.perf_counter() - started
        tokens = sum(entry.num_new_tokens for entry in scheduled)
        if tokens == len(scheduled):
            self.decode.append((len(scheduled), seconds))
        else:
            self.prefill.append((tokens, seconds))
        return logits

    def summary(self) -> dict:
        decode_rows = sum(rows for rows, _ in self.decode)
        return {"decode_steps": len(self.decode), "decode_rows": decode_rows,
                "decode_mean_batch": round(decode_rows / len(self.decode), 2) if self.decode else 0.0,
                "decode_seconds": round(sum(s for _, s in self.decode), 2),
                "prefill_steps": len(self.prefill), "prefill_tokens": sum(t for t, _ in self.prefill),
                "prefill_seconds": round(sum(s for _, s in self.prefill), 2)}


def example_request(body: dict, settings: Settings, request_id: str) -> GenerateRequest:
    """The runtime request the server makes of this chat completion body."""
    chat = ChatCompletionRequest(model=None, messages=MESSAGES, **body)
    return GenerateRequest(request_id=request_id, endpoint="chat", messages=chat.wire_messages(),
                           sampling=chat.to_sampling(),
                           search=chat.search.to_params(False, settings.search.max_timeout_s))


def run(model: str | None, quick: bool, deterministic: bool = False, verifier: str | None = None,
        max_tokens: int | None = None) -> dict:
    settings = Settings.load(None, model={"path": model}, scheduler={"batch_invariant": deterministic or None})
    engine, source = build_engine(settings.runtime_options())
    steps = StepLog(engine.runner)
    body = dict(QUICK if quick else EXAMPLE)
    body["search"] = {**body["search"], **({"verifier": verifier} if verifier else {})}
    body["max_tokens"] = max_tokens or body["max_tokens"]
    request = example_request(body, settings, "bench-example")
    warm_up()  # as the runtime process does once it is ready
    _, finished, seconds = searched(engine, request)
    summary = finished.search
    spec = engine.stats["speculative_tokens"]
    model_steps = steps.summary()
    engine.runner.execute = steps.execute  # the plain rate runs unobserved
    plain = plain_rate(engine, request, 8 if quick else 64)
    return {"model": source.name, "quantize": engine.quantized.mode, "threads": torch.get_num_threads(), "isa": kernel_isa(),
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
            "speculative_tokens_used": spec.get("used", 0), "speculative_tokens_discarded": spec.get("discarded", 0),
            **model_steps}


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
    head = (f"search example: {r['model']} ({r['quantize']}{mode}), {r['threads']} threads, {r['isa']} kernel, {search['strategy']} "
            f"n={search['n']} width={search['beam_width']}, {search['verifier']}, max_tokens "
            f"{r['request']['max_tokens']}, seed {r['request']['seed']}")
    rows = [["seconds", r["seconds"]], ["generated tokens", r["tokens_generated"]], ["tok/s", r["tok_s"]],
            ["plain n=16 tok/s (same engine)", r["plain_16_tok_s"]],
            ["search tok/s / plain n=16", f"{r['vs_plain_16']:.2f}x"],
            ["s generating", r["seconds_generating"]], ["s verifying", r["seconds_verifying"]],
            ["judge tokens prefilled", r["verifier_tokens_prefilled"]],
            ["search steps", r["steps"]], ["paths explored", r["paths_explored"]],
            ["speculative tokens used / discarded",
             f"{r['speculative_tokens_used']} / {r['speculative_tokens_discarded']}"],
            ["decode steps (mean batch)", f"{r['decode_steps']} ({r['decode_mean_batch']})"],
            ["s in decode steps", r["decode_seconds"]],
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
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    results = run(args.model, args.quick, args.deterministic, args.verifier, args.max_tokens)
    emit(results, table(results), args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
