"""Accuracy against compute: does search make the model answer better, and at what token cost?

    ponder bench accuracy [--model PATH] [--config FILE] [--dataset FILE] [--levels 1,2] [--limit K]
                          [--quick | --full] [--methods M,...] [--verifier V,...] [--n 1,4,16] [--per-level K]
                          [--configs beam:calculator@8,...] [--seed S] [--temperature T] [--max-tokens T]
                          [--deterministic [--concurrency K]] [--no-greedy-anchor] [--threads N] [--json PATH]
                          [--plot PATH]
    ponder bench accuracy --power [--pilot JSON]

The problems come from `bench.problems` (levels 1-7: arithmetic, then word problems; exact integer answers,
one seed) or, with `--dataset`, from the user's JSON Lines file in MATH-500, GSM8K or plain question/answer
shape (`bench.datasets`).
`--config` is a `ponder serve` settings file: the generator, device and KV settings are the server's, and
each `[verifiers.NAME]` reward model in it is loaded and can be named in `--verifier`. Each problem runs
through the engine's search entry point, one request at a time, exactly as a chat request with `search`:

- `greedy`: one pass at temperature 0 (N = 1 only);
- `majority`: N independent samples, the most frequent answer (self-consistency);
- `best_of_n`: N independent samples split into steps, each step scored by the verifier, the best wins;
- `beam`: step-wise beam search, keep N / 4 paths after each step and refill to N;
- `dvts`: N / 4 independent subtrees, each expands its own best step four ways;
- `particle_filtering`: N particles resampled after each step by their verifier weights (its_hub's);
- `deepconf`: N traces, no verifier: a warm-up of N / 4 sets a confidence threshold, later traces stop
  when their confidence over a window of a quarter of `max_tokens` falls below it, the rest vote weighted
  by confidence (docs/search-deepconf.md).

The verifier methods run with the greedy anchor, as a search does by default (`runtime.search.anchor`:
greedy decoding's path beside the N, the answer unless a candidate outranks it); `--no-greedy-anchor`
runs them without it. Majority voting and DeepConf never have it: their N samples vote alone.

The verifier methods run once per verifier in `--verifiers` (`judge`, `confidence` and `calculator` need
no model besides the generator; others come from `--config`); `--configs` adds single configurations
beside that grid. Greedy and majority voting at every N run whatever
`--methods` says: they are the baselines. The chosen answer is the engine's own (the first choice's
`search.answer`); it is graded against the exact answer with the same math-verify equivalence the
search votes with. No extractable, parseable answer counts as wrong and is counted as unparsed.
`--deterministic` runs the engine batch-invariant (as `ponder serve --deterministic`): each problem's
tokens are then what they would be alone and cold, so any subset or order of a run gives the same
answers, and `--concurrency K` may put K problems' requests in the engine at once (faster, same answers).

Reported per method and N: accuracy with a 95 % Wilson interval, per level, the generator's sampled
tokens and the verifier's prefilled tokens (per problem), wall seconds and generator tokens per second;
a PNG of accuracy against generated tokens, one line per method. Every method is then compared, problem
by problem, with greedy decoding and with majority voting at the nearest generated tokens
(`bench.paired.comparisons`): the difference in accuracy with Newcombe's paired 95 % interval and the
exact McNemar p-value, and in words which differences are significant at 0.05.

`--power` sizes a comparison instead of running one (no model is loaded): the problems McNemar's test needs
to detect a 10-point difference at 80 % power for discordance rates of 15-30 %; with `--pilot JSON` (an
earlier run's `--json`, with greedy in it) also the levels where greedy is right on 20-70 % of the problems
(pass them as `--levels`) and the discordance each method showed there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench import paired
from bench.accuracy_configs import METHODS, VERIFIED, VERIFIERS, Config, names, parse_configs, plan, with_baselines
from bench.accuracy_inputs import choose_problems, int_list, runtime_options
from bench.accuracy_report import pilot_lines, plot, table
from bench.problems import Problem
from bench.report import emit, plot_path
from bench.threads import torch_threads

OUT_DIR = Path(__file__).resolve().parent / "out"
BEAM_WIDTH = 4
Z_95 = 1.959963984540054

# Few-shot in the chat itself: a 135M model follows a shown format far better than a described one.
SYSTEM_PROMPT = ("Solve the math problem. Write each step on its own line, separated by a blank line, and end "
                 "with: The final answer is $\\boxed{answer}$.")
EXAMPLES = (
    ("What is 23 + 45?", "23 + 45 = 68.\n\nThe final answer is $\\boxed{68}$."),
    ("Tom has 5 apples. He buys 3 more and then eats 2. How many apples does Tom have now?",
     "Tom has 5 apples and buys 3 more: 5 + 3 = 8.\n\nHe eats 2: 8 - 2 = 6.\n\nThe final answer is $\\boxed{6}$."),
)


@dataclass(frozen=True)
class Setup:
    max_tokens: int = 96
    max_steps: int = 6
    max_step_tokens: int = 48
    temperature: float = 0.8
    seed: int = 0
    greedy_anchor: bool = True  # for the verifier methods (majority voting never has it)


@dataclass(frozen=True)
class Outcome:
    """One problem answered by one configuration."""

    answer: str | None
    status: str  # correct | wrong | unparsed
    tokens_generated: int
    verifier_tokens: int
    seconds: float
    anchor_tokens: int = 0  # of tokens_generated, the greedy anchor's
    by_anchor: bool = False  # the anchor's text is the answer: no candidate outranked it


# ---------------------------------------------------------------------------------------------
# grading (what runs: bench.accuracy_configs; the problems and the engine: bench.accuracy_inputs)


def grade(answer: str | None, problem: Problem) -> str:
    """`correct`, `wrong`, or `unparsed`: no answer, or one in which math-verify finds no expression (its
    parse then holds only the raw text)."""
    from math_verify import parse

    from runtime.search.answers import answers_equivalent

    if answer is None or not answer.strip():
        return "unparsed"
    if answers_equivalent(problem.gold, answer):
        return "correct"
    parsed = parse("$" + answer.replace("$", "") + "$")
    return "wrong" if any(not isinstance(x, str) for x in parsed) else "unparsed"


def wilson(correct: int, total: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion."""
    return paired.wilson(correct, total, z)


# ---------------------------------------------------------------------------------------------
# running


def messages_for(question: str) -> tuple[dict[str, str], ...]:
    shots = [m for q, a in EXAMPLES for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
    return ({"role": "system", "content": SYSTEM_PROMPT}, *shots, {"role": "user", "content": question})


def request_for(problem: Problem, config: Config, setup: Setup, request_id: str):
    from runtime.wire.params import SamplingParams, SearchParams
    from runtime.wire.protocol import GenerateRequest

    stepwise = config.method in VERIFIED
    greedy = config.method == "greedy"
    search = SearchParams(
        strategy="best_of_n" if config.method in ("greedy", "majority", "best_of_n") else config.method,
        n=config.n, beam_width=min(BEAM_WIDTH, config.n), max_steps=setup.max_steps if stepwise else 1,
        max_step_tokens=setup.max_step_tokens, step_delimiter="\n\n",
        # Without a verifier of their own, greedy and majority take `confidence`: its score is the
        # sampled tokens' own log-probabilities, kept while sampling, so it costs nothing.
        verifier=config.verifier or "confidence", select="majority" if config.method == "majority" else "best",
        greedy_anchor=setup.greedy_anchor and stepwise,
        # DeepConf's window scaled to these short answers (the paper's 2048 is for traces of thousands of tokens).
        deepconf_window=max(8, setup.max_tokens // 4))
    sampling = SamplingParams(max_tokens=setup.max_tokens, temperature=0.0 if greedy else setup.temperature,
                              seed=setup.seed, n=1)
    return GenerateRequest(request_id=request_id, endpoint="chat", messages=messages_for(problem.question),
                           sampling=sampling, search=search)


def solve(engine, problems: list[Problem], config: Config, setup: Setup, prefix: str, concurrency: int = 1,
          on_done=lambda: None) -> list[Outcome]:
    """Every problem answered by `config`, `concurrency` requests in the engine at a time (each problem's
    own request, as a client would send it); outcomes in the problems' order."""
    from runtime.wire.protocol import Finished, RequestError

    outcomes: list[Outcome | None] = [None] * len(problems)
    pending = list(reversed(range(len(problems))))
    running: dict[str, tuple[int, float, list]] = {}
    while pending or running:
        while pending and len(running) < concurrency:
            index = pending.pop()
            request_id = f"{prefix}-{index}"
            running[request_id] = (index, time.perf_counter(),
                                   list(engine.add_request(request_for(problems[index], config, setup, request_id))))
        if engine.has_work:
            for message in engine.step():
                if getattr(message, "request_id", None) in running:
                    running[message.request_id][2].append(message)
        for request_id, (index, started, messages) in list(running.items()):
            if isinstance(messages[-1], (Finished, RequestError)) or not engine.has_work:
                del running[request_id]
                outcomes[index] = _outcome(messages, problems[index], config, time.perf_counter() - started)
                on_done()
    return outcomes


def _outcome(messages: list, problem: Problem, config: Config, seconds: float) -> Outcome:
    from runtime.wire.protocol import Delta, Finished, RequestError

    finished = messages[-1]
    if isinstance(finished, RequestError):
        raise ValueError(f"{config.label} N={config.n}: {finished.message}")
    if not isinstance(finished, Finished) or finished.search is None:
        raise RuntimeError(f"the search did not finish: {finished}")
    first = next(m for m in messages if isinstance(m, Delta) and m.index == 0 and m.finish_reason is not None)
    answer = first.search.answer if first.search else None
    return Outcome(answer, grade(answer, problem), finished.search.tokens_generated,
                   finished.search.verifier_tokens_prefilled, seconds, finished.search.anchor_tokens,
                   bool(finished.search.answered_by_anchor))


def summarize(config: Config, problems: list[Problem], outcomes: list[Outcome], seconds: float) -> dict:
    """One row of results; `seconds` is the wall time of the whole set (its requests may overlap)."""
    total = len(outcomes)
    correct = sum(o.status == "correct" for o in outcomes)
    low, high = wilson(correct, total)
    generated = sum(o.tokens_generated for o in outcomes)
    by_level = {}
    for level in levels_of(problems):
        mine = [o for p, o in zip(problems, outcomes) if p.level == level]
        by_level[str(level)] = round(sum(o.status == "correct" for o in mine) / len(mine), 3)
    return {"method": config.method, "verifier": config.verifier, "n": config.n, "label": config.label,
            "problems": total, "correct": correct, "unparsed": sum(o.status == "unparsed" for o in outcomes),
            "accuracy": round(correct / total, 3), "ci95": [round(low, 3), round(high, 3)], "by_level": by_level,
            "tokens_generated": round(generated / total, 1),
            "verifier_tokens": round(sum(o.verifier_tokens for o in outcomes) / total, 1),
            "anchor_tokens": round(sum(o.anchor_tokens for o in outcomes) / total, 1),
            "answered_by_anchor": sum(o.by_anchor for o in outcomes),
            "seconds": round(seconds, 2), "tok_s": round(generated / seconds, 2) if seconds else 0.0,
            "answers": [o.answer for o in outcomes], "statuses": [o.status for o in outcomes]}


def levels_of(problems: list[Problem]) -> list[int]:
    return sorted({p.level for p in problems if p.level is not None})


def run(options, configs: list[Config], problems: list[Problem], setup: Setup, progress: bool = True,
        concurrency: int = 1) -> dict:
    """Every configuration on every problem, on an engine built from `options` (RuntimeOptions), with
    `concurrency` problems' requests in the engine at a time."""
    import torch
    from tqdm import tqdm

    from runtime.bootstrap import build_engine

    engine, source = build_engine(options)
    solve(engine, problems[:1], Config("greedy", None, 1), Setup(max_tokens=4), "accuracy-warm-up")
    bar = tqdm(total=len(configs) * len(problems), desc="accuracy", unit="problem", disable=not progress,
               file=sys.stderr)
    rows = []
    for index, config in enumerate(configs):
        bar.set_postfix_str(f"{config.label} N={config.n}")
        started = time.perf_counter()
        outcomes = solve(engine, problems, config, setup, f"accuracy-{index}", concurrency, bar.update)
        rows.append(summarize(config, problems, outcomes, time.perf_counter() - started))
    bar.close()
    return {"model": source.name, "threads": torch.get_num_threads(), "problems": len(problems),
            "levels": levels_of(problems), "seed": setup.seed, "max_tokens": setup.max_tokens,
            "max_steps": setup.max_steps, "max_step_tokens": setup.max_step_tokens,
            "temperature": setup.temperature, "beam_width": BEAM_WIDTH,
            "deterministic": engine.padding is not None, "concurrency": concurrency, "results": rows,
            "comparisons": paired.comparisons(rows), "alpha": paired.ALPHA, "gold": [p.gold for p in problems]}


QUICK = dict(methods="greedy,majority,best_of_n", verifiers="confidence", n="1,4,16", per_level=2,
             max_tokens=48, max_steps=4, max_step_tokens=24)
DEFAULT = dict(methods=",".join(METHODS), verifiers=",".join(VERIFIERS), n="1,4,16", per_level=8,
               max_tokens=96, max_steps=6, max_step_tokens=48)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.power:
            return _power(args)
        chosen = dict(QUICK if args.quick else DEFAULT)
        if args.full:
            chosen["n"] = "1,4,16,64"
        if args.temperature is not None and not 0 < args.temperature <= 2:
            raise ValueError(f"--temperature must be in (0, 2], got {args.temperature}")
        if args.concurrency < 1:
            raise ValueError(f"--concurrency must be at least 1, got {args.concurrency}")
        if args.concurrency > 1 and not args.deterministic:
            raise ValueError("--concurrency above 1 needs --deterministic: otherwise a problem's answer would depend "
                             "on the problems that share its batches")
        options, known = runtime_options(args.model, args.config, args.deterministic)
        configs = plan(names(args.methods or chosen["methods"]), names(args.verifiers or chosen["verifiers"]),
                       int_list(args.n or chosen["n"]), known)
        configs += [c for c in parse_configs(args.configs or "", known) if c not in configs]
        per_level = args.per_level or chosen["per_level"]
        if per_level < 1:
            raise ValueError(f"--per-level must be at least 1, got {per_level}")
        if args.quick:  # N = 1 is greedy's alone
            configs = [c for c in configs if c.n > 1 or c.method == "greedy"]
        problems = choose_problems(args.dataset, args.levels, args.limit, args.seed, per_level)
    except ValueError as exc:  # a DatasetError too
        print(f"ponder bench accuracy: error: {exc}", file=sys.stderr)
        return 2
    setup = Setup(max_tokens=args.max_tokens or chosen["max_tokens"], max_steps=args.max_steps or chosen["max_steps"],
                  max_step_tokens=args.max_step_tokens or chosen["max_step_tokens"], seed=args.seed,
                  temperature=args.temperature or Setup.temperature, greedy_anchor=not args.no_greedy_anchor)
    with torch_threads(args.threads):
        results = run(options, with_baselines(configs), problems, setup, concurrency=args.concurrency)
    results["dataset"] = args.dataset
    path = plot_path(args.plot_path, args.json_path, OUT_DIR / ("accuracy-quick.png" if args.quick else "accuracy.png"))
    results["plot"] = str(path)
    plot(results, path)
    emit(results, table(results), args.json_path)
    return 0


def _power(args) -> int:
    table_rows = paired.power_table()
    results: dict = {"power": table_rows}
    lines = paired.power_lines(table_rows)
    if args.pilot:
        try:
            with open(args.pilot) as f:
                pilot = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{args.pilot}: cannot read the pilot: {exc}") from None
        try:
            results["pilot"] = paired.pilot_advice(pilot)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{args.pilot}: not an accuracy benchmark's JSON (no {exc})") from None
        lines += pilot_lines(args.pilot, results["pilot"])
    emit(results, "\n".join(lines), args.json_path)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ponder bench accuracy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="the generator (default: the config's, else the embedded one)")
    parser.add_argument("--config", default=None, help="a `ponder serve` TOML settings file: model, device, KV "
                                                       "settings and [verifiers.NAME] reward models")
    parser.add_argument("--dataset", default=None, help="JSON Lines: MATH-500 (problem, answer), GSM8K (question, "
                                                        "answer ending '#### N') or plain (question, answer)")
    parser.add_argument("--levels", default=None, help="comma-separated levels to keep (generated set, or a "
                                                       "dataset with a level field)")
    parser.add_argument("--limit", type=int, default=None, help="only the first K problems")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="2 problems a level, max_tokens 48, greedy, majority and best_of_n:confidence at N 4 and "
                           "16 (about 7 minutes on 2 cores)")
    size.add_argument("--full", action="store_true", help="N up to 64")
    size.add_argument("--power", action="store_true", help="print how many problems a paired comparison needs "
                                                          "(no model is run)")
    parser.add_argument("--pilot", default=None, help="with --power: an earlier run's JSON to choose levels from")
    parser.add_argument("--methods", default=None, help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--verifiers", "--verifier", dest="verifiers", default=None,
                        help=f"for {', '.join(VERIFIED)}: of {', '.join(VERIFIERS)} or a [verifiers.NAME] of --config")
    parser.add_argument("--n", default=None, help="comma-separated N (paths) to try, each >= 1")
    parser.add_argument("--configs", default=None, help="more configurations beside the methods x verifiers x N "
                                                        "grid, as method[:verifier]@N,... (e.g. beam:calculator@8)")
    parser.add_argument("--per-level", type=int, default=None, help="problems per level")
    parser.add_argument("--seed", type=int, default=0, help="the problem set's seed and the sampling seed")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=None, help="search steps of the step-wise methods")
    parser.add_argument("--max-step-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None,
                        help=f"the sampling temperature of every method but greedy (default {Setup.temperature})")
    parser.add_argument("--deterministic", action="store_true",
                        help="as `ponder serve --deterministic`: every problem's tokens as they would be alone and "
                             "cold, so any subset or order of the run gives the same answers")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="problems in the engine at a time (needs --deterministic; default 1)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1, as the other benchmarks: shared cores)")
    parser.add_argument("--no-greedy-anchor", action="store_true",
                        help="run the verifier methods without the greedy anchor (runtime.search.anchor)")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--plot", dest="plot_path", default=None,
                        help="PNG path (default: next to --json, else bench/out/accuracy.png)")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
