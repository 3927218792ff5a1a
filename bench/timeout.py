"""Whether a search's time budget is met: the search example of docs/benchmarks.md cut by `timeout_s`.

    ponder bench timeout [--model PATH] [--budgets 2,5] [--max-tokens 512] [--json PATH]

The search of `ponder bench example` (beam, n 16, beam width 4, `max_tokens` 512, which runs for about
a minute on a CPU) is sent with `search.timeout_s` = T through the server's request schema, to engines
built from the server's settings, in-process as the runtime process drives them. Configurations:

- `judge`: default settings, the `judge` verifier (a model verification may be under way at T);
- `judge, small pool`: the same with a compute pool of 64 blocks and a 64 MiB host tier below it,
  so paths are grouped and their blocks move between tiers when the deadline comes;
- `calculator`: default settings, the default verifier.

Per budget and configuration: the seconds from `add_request` to the answer, the bound the search
promises (T x 1.1 + 0.5 s), whether it was met, and the answer's `timed_out`, `cut_step_verified`,
steps and tokens. Model loading is not timed.
"""

from __future__ import annotations

import argparse
import time

from bench.example import EXAMPLE, example_request
from bench.report import columns, emit
from bench.search import searched
from runtime.bootstrap import build_engine
from server.config import Settings

CONFIGS = {
    "judge": ({"verifier": "judge"}, {}),
    "judge, small pool": ({"verifier": "judge"}, {"cache": {"num_blocks": 64, "host_memory_gib": 1 / 16}}),
    "calculator": ({"verifier": "calculator"}, {}),
}


def bound(budget: float) -> float:
    """The latest a search with `timeout_s = budget` may answer (docs/search.md, "The `search` object")."""
    return budget * 1.1 + 0.5


def run(model: str | None, budgets: list[float], max_tokens: int = EXAMPLE["max_tokens"]) -> dict:
    rows = []
    for name, (search, sections) in CONFIGS.items():
        settings = Settings.load(None, model={"path": model}, **sections)
        engine, source = build_engine(settings.runtime_options())
        for budget in budgets:
            body = {**EXAMPLE, "max_tokens": max_tokens, "search": {**EXAMPLE["search"], **search, "timeout_s": budget}}
            request = example_request(body, settings, f"bench-timeout-{time.monotonic_ns()}")
            _, finished, seconds = searched(engine, request)
            summary = finished.search
            rows.append({"config": name, "timeout_s": budget, "seconds": round(seconds, 2),
                         "bound_s": round(bound(budget), 2), "met": seconds <= bound(budget),
                         "timed_out": summary.timed_out, "cut_step_verified": summary.cut_step_verified,
                         "steps": summary.steps, "tokens_generated": summary.tokens_generated})
        engine.close()
    return {"model": source.name, "request": {**EXAMPLE, "max_tokens": max_tokens}, "results": rows,
            "all_met": all(row["met"] for row in rows)}


def table(results: dict) -> str:
    header = ["config", "timeout_s", "seconds", "bound", "met", "timed out", "cut step verified", "steps", "tokens"]
    body = [[r["config"], f"{r['timeout_s']:g}", f"{r['seconds']:.2f}", f"{r['bound_s']:.2f}",
             "yes" if r["met"] else "NO", str(r["timed_out"]).lower(), str(r["cut_step_verified"]).lower(),
             str(r["steps"]), str(r["tokens_generated"])] for r in results["results"]]
    return "\n".join([f"timeout: {results['model']}, the search example cut at timeout_s "
                      f"(bound T x 1.1 + 0.5 s): {'every bound met' if results['all_met'] else 'a bound MISSED'}",
                      *columns(header, body, 18)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench timeout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--budgets", default="2,5", help="timeout_s values, comma-separated (at least 1 each)")
    parser.add_argument("--max-tokens", type=int, default=EXAMPLE["max_tokens"],
                        help="the search's max_tokens (default the example's; a small model's context may need less)")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    if not budgets or min(budgets) < 1:
        parser.error("--budgets: one or more values of at least 1 (the server's smallest timeout_s)")
    results = run(args.model, budgets, args.max_tokens)
    emit(results, table(results), args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
