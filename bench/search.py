"""Search goodput: ponder's beam search against a search-and-learn-style transformers loop, same model,
same run.

    ponder bench search [--model PATH] [--prompts K] [--max-steps N] [--quick] [--threads N] [--json PATH]

Both systems run the same step-wise beam search (n paths, keep n // beam_width, refill by cyclic
duplication, drop duplicate texts, a path ends on EOS, length or an empty step, the last step runs
without the delimiter) with the `judge` verifier, on the same model object, for a few grade-school
math problems. They differ only in how the work is done:

- ponder: one engine request. Paths are forked sequences that share their KV blocks, each step
  decodes on top of the path's cache, and the judge's questions go through the same paged store, so
  each verification prefills only what the prefix cache does not already hold.
- baseline: a loop over `model.generate` (sdpa attention) that re-prefills the prompt and the whole
  path text of every path at every step, and re-scores the full text of every path at every step with
  `JudgeVerifier.score` (plain transformers forwards; one judge question per step of the path).

Precise goodput (FastTTS): the mean tokens of a returned path divided by the mean completion time.
Every final path is returned (up to n), so the mean is over all of them and no single straggler or
lucky path decides it. Tokens generated count every sampled token of every path; verifier share is
the part of the completion time spent scoring. The problems run one after another, each on both
systems in turn, after a small warm-up search on each; torch runs one thread unless --threads says.

Then ponder's searches run again on two more engines, speculative extension off and on: their decode
steps per search beside the longest path's tokens (no schedule takes fewer steps) and the steps 16
plain streams take for as many tokens, figures that do not depend on the device.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from bench.report import emit
from bench.steps import LongestPath, StepLog
from bench.threads import torch_threads
from runtime.model import attention
from runtime.bootstrap import build_engine
from runtime.wire.params import SamplingParams, SearchParams
from runtime.wire.protocol import Delta, Finished, GenerateRequest
from runtime.wire.options import RuntimeOptions
from runtime.search.aggregate import aggregate, normalize_step, refill
from runtime.search.answers import Candidate, extract_answer, select
from runtime.search.strategies import drop_duplicates, rank

SYSTEM_PROMPT = (
    "Solve the following math problem efficiently and clearly. Think step by step, and separate the steps "
    "with a blank line. Always conclude with:\n\n"
    "Therefore, the final answer is: $\\boxed{answer}$.\n\n"
    "Where [answer] is just the final number or expression that solves the problem."
)

WARM_UP_PROBLEM = "What is 2 + 3?"

PROBLEMS = (
    "A baker makes 24 muffins. She sells 15 of them and then bakes 8 more. How many muffins does she have now?",
    "Tom has 3 boxes with 12 pencils in each box. He gives 10 pencils to his sister. How many pencils does he "
    "have left?",
    "A train travels 60 miles per hour for 3 hours, then 40 miles per hour for 2 hours. How far does it go "
    "in total?",
    "Sara buys 4 notebooks at $3 each and a pen for $2. She pays with a $20 bill. How much change does she get?",
)


@dataclass(frozen=True)
class Setup:
    n: int = 16
    beam_width: int = 4
    max_steps: int = 4
    max_step_tokens: int = 32
    max_tokens: int = 128
    temperature: float = 0.8
    delimiter: str = "\n\n"


@dataclass
class Outcome:
    """One search of one problem by one system."""

    seconds: float
    returned_tokens: list[int]  # per returned path
    tokens_generated: int
    generator_tokens_prefilled: int
    seconds_generating: float
    seconds_verifying: float
    verifier_tokens_prefilled: int
    best_answer: str | None


def messages_for(problem: str) -> tuple[dict[str, str], ...]:
    return ({"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem})


# ---------------------------------------------------------------------------------------------
# ponder


def searched(engine, request: GenerateRequest) -> tuple[list, Finished, float]:
    """Run one search request on `engine` until it is idle: (every message, the Finished one, seconds)."""
    started = time.perf_counter()
    messages = list(engine.add_request(request))
    while engine.has_work:
        messages += engine.step()
    seconds = time.perf_counter() - started
    finished = messages[-1]
    if not isinstance(finished, Finished) or finished.search is None:
        raise RuntimeError(f"the search did not finish: {finished}")
    return messages, finished, seconds


def run_ponder(engine, problem: str, setup: Setup, seed: int) -> Outcome:
    request = GenerateRequest(
        request_id=f"bench-search-{seed}-{time.monotonic_ns()}", endpoint="chat", messages=messages_for(problem),
        sampling=SamplingParams(max_tokens=setup.max_tokens, temperature=setup.temperature, seed=seed, n=setup.n),
        search=SearchParams(strategy="beam", n=setup.n, beam_width=setup.beam_width, max_steps=setup.max_steps,
                            max_step_tokens=setup.max_step_tokens, step_delimiter=setup.delimiter,
                            verifier="judge"))
    messages, finished, seconds = searched(engine, request)
    final = [m for m in messages if isinstance(m, Delta) and m.finish_reason is not None]
    best = min(final, key=lambda m: m.index)
    summary = finished.search
    return Outcome(seconds, [len(m.token_ids) for m in final], summary.tokens_generated,
                   finished.prompt_tokens - finished.cached_tokens, summary.seconds_generating,
                   summary.seconds_verifying, summary.verifier_tokens_prefilled,
                   best.search.answer if best.search else None)


# ---------------------------------------------------------------------------------------------
# baseline: search-and-learn's loop over transformers


@dataclass(eq=False)
class BaselinePath:
    uid: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    step_scores: list[float] = field(default_factory=list)
    is_done: bool = False

    @property
    def score(self) -> float:
        return aggregate(self.step_scores, "last") if self.step_scores else float("-inf")


class StepEnd(StoppingCriteria):
    """Ends a row once its new text holds the step delimiter or it reached its own token cap."""

    def __init__(self, tokenizer, prompt_width: int, caps: list[int], delimiter: str | None) -> None:
        self.tokenizer = tokenizer
        self.prompt_width = prompt_width
        self.caps = caps
        self.delimiter = delimiter

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        new = input_ids[:, self.prompt_width:]
        ended = [new.shape[1] >= cap for cap in self.caps]
        if self.delimiter is not None:
            texts = self.tokenizer.batch_decode(new, skip_special_tokens=True)
            ended = [e or self.delimiter in t for e, t in zip(ended, texts)]
        return torch.tensor(ended, dtype=torch.bool, device=input_ids.device)


class BaselineSearch:
    def __init__(self, model, tokenizer, judge, eos_ids, setup: Setup) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.judge = judge
        self.eos_ids = set(eos_ids)
        self.setup = setup
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.sampling = dict(do_sample=True, temperature=setup.temperature, top_p=1.0, top_k=0,
                             eos_token_id=sorted(self.eos_ids), pad_token_id=pad)
        self.next_uid = 0
        self.stats = dict(tokens_generated=0, generator_tokens_prefilled=0, seconds_generating=0.0,
                          seconds_verifying=0.0, verifier_tokens_prefilled=0)

    def new_path(self, parent: BaselinePath | None = None) -> BaselinePath:
        path = BaselinePath(self.next_uid)
        self.next_uid += 1
        if parent is not None:
            path.text, path.token_ids = parent.text, list(parent.token_ids)
            path.steps, path.step_scores = list(parent.steps), list(parent.step_scores)
        return path

    def run(self, problem: str, seed: int) -> Outcome:
        setup = self.setup
        torch.manual_seed(seed)
        started = time.perf_counter()
        prompt = self.tokenizer.apply_chat_template(list(messages_for(problem)), add_generation_prompt=True,
                                                    tokenize=False)
        paths = [self.new_path() for _ in range(setup.n)]
        final: list[BaselinePath] = []
        for step in range(setup.max_steps):
            is_last = step == setup.max_steps - 1
            self.generate_step(prompt, paths, is_last)
            self.verify(problem, paths)
            final += [p for p in paths if p.is_done]
            live = [p for p in paths if not p.is_done]
            if is_last or not live:
                final += live
                break
            survivors = rank(drop_duplicates(live))[:max(1, setup.n // setup.beam_width)]
            paths, seen = [], set()
            for parent in refill(survivors, setup.n):
                paths.append(self.new_path(parent) if parent.uid in seen else parent)
                seen.add(parent.uid)
        seconds = time.perf_counter() - started
        order = select([Candidate(extract_answer(p.text), p.score) for p in final], "best")
        returned = [final[i] for i in order[:setup.n]]
        # As the engine reports them: a path that ended on EOS returns its tokens without the EOS.
        counts = [len(p.token_ids) - int(bool(p.token_ids) and p.token_ids[-1] in self.eos_ids) for p in returned]
        return Outcome(seconds, counts, self.stats["tokens_generated"], self.stats["generator_tokens_prefilled"],
                       self.stats["seconds_generating"],
                       self.stats["seconds_verifying"], self.stats["verifier_tokens_prefilled"],
                       extract_answer(returned[0].text))

    def generate_step(self, prompt: str, paths: list[BaselinePath], is_last: bool) -> None:
        """One step of every path in one batched `generate`, re-prefilling prompt + path text."""
        setup = self.setup
        started = time.perf_counter()
        batch = self.tokenizer([prompt + p.text for p in paths], return_tensors="pt", padding=True,
                               padding_side="left", add_special_tokens=False).to(self.model.device)
        width = batch["input_ids"].shape[1]
        self.stats["generator_tokens_prefilled"] += int(batch["attention_mask"].sum())
        caps = [setup.max_tokens - len(p.token_ids) if is_last
                else min(setup.max_step_tokens, setup.max_tokens - len(p.token_ids)) for p in paths]
        stop = StepEnd(self.tokenizer, width, caps, None if is_last else setup.delimiter)
        with torch.inference_mode():
            config = GenerationConfig(max_new_tokens=max(caps), **self.sampling)
            out = self.model.generate(**batch, generation_config=config, stopping_criteria=StoppingCriteriaList([stop]))
        for path, row, cap in zip(paths, out[:, width:].tolist(), caps):
            self.take_step(path, row, cap, is_last)
        self.stats["seconds_generating"] += time.perf_counter() - started

    def take_step(self, path: BaselinePath, row: list[int], cap: int, is_last: bool) -> None:
        """Read one row of new tokens with the engine's rules: EOS, length, delimiter, step cap, empty."""
        setup = self.setup
        step_ids: list[int] = []
        ends_step = False
        for token in row:
            step_ids.append(token)
            text = self.tokenizer.decode(step_ids, skip_special_tokens=True)
            if token in self.eos_ids:
                path.is_done = True
            elif len(path.token_ids) + len(step_ids) >= setup.max_tokens:
                path.is_done = True
            elif not is_last and (setup.delimiter in text or len(step_ids) >= cap):
                ends_step = True
            if ends_step and not normalize_step(text, setup.delimiter).strip():
                path.is_done = True
            if ends_step or path.is_done:
                break
        self.stats["tokens_generated"] += len(step_ids)
        path.token_ids += step_ids
        path.steps.append(normalize_step(self.tokenizer.decode(step_ids, skip_special_tokens=True),
                                         setup.delimiter))
        path.text = self.tokenizer.decode(path.token_ids, skip_special_tokens=True)

    def verify(self, problem: str, paths: list[BaselinePath]) -> None:
        """Every path's full text, every step of it, re-scored; the latest step's score is kept."""
        started = time.perf_counter()
        scores = self.judge.score(problem, [p.steps for p in paths])
        self.stats["seconds_verifying"] += time.perf_counter() - started
        for path, path_scores in zip(paths, scores):
            path.step_scores = list(path_scores)
            self.stats["verifier_tokens_prefilled"] += sum(
                len(x.token_ids) for x in self.judge.build_inputs(problem, path.steps))


def run_baseline(engine, problem: str, setup: Setup, seed: int) -> Outcome:
    judge = engine.scorers["judge"].judge
    return BaselineSearch(engine.model, engine.tokenizer, judge, engine.eos_ids, setup).run(problem, seed)


# ---------------------------------------------------------------------------------------------
# the run


def summarize(outcomes: list[Outcome]) -> dict:
    returned = [t for o in outcomes for t in o.returned_tokens]
    latency = sum(o.seconds for o in outcomes) / len(outcomes)
    mean_returned = sum(returned) / len(returned)
    busy = sum(o.seconds_generating + o.seconds_verifying for o in outcomes)
    return {
        "goodput_tok_s": round(mean_returned / latency, 3),
        "latency_s": round(latency, 3),
        "tokens_returned": round(mean_returned, 1),
        "paths_returned": round(len(returned) / len(outcomes), 1),
        "tokens_generated": round(sum(o.tokens_generated for o in outcomes) / len(outcomes), 1),
        "generator_tokens_prefilled": round(sum(o.generator_tokens_prefilled for o in outcomes) / len(outcomes), 1),
        "seconds_generating": round(sum(o.seconds_generating for o in outcomes) / len(outcomes), 2),
        "seconds_verifying": round(sum(o.seconds_verifying for o in outcomes) / len(outcomes), 2),
        "verifier_share": round(sum(o.seconds_verifying for o in outcomes) / busy, 3) if busy else 0.0,
        "verifier_tokens_prefilled": round(sum(o.verifier_tokens_prefilled for o in outcomes) / len(outcomes), 1),
        "latencies_s": [round(o.seconds, 2) for o in outcomes],
        "answers": [o.best_answer for o in outcomes],
    }


def run(model: str | None, num_prompts: int, setup: Setup, seed: int = 0) -> dict:
    engine, source = build_engine(RuntimeOptions(model=model, device="cpu"))
    model_obj = engine.model
    # Warm-up (allocator, first-call overheads) on both sides.
    tiny = Setup(n=2, beam_width=2, max_steps=2, max_step_tokens=4, max_tokens=8)
    run_ponder(engine, WARM_UP_PROBLEM, tiny, seed)
    model_obj.set_attn_implementation("sdpa")
    run_baseline(engine, WARM_UP_PROBLEM, tiny, seed)
    ours, baseline = [], []
    try:
        # Interleaved per problem, so load from elsewhere on the machine hits both systems alike.
        for index, problem in enumerate(PROBLEMS[:num_prompts]):
            model_obj.set_attn_implementation(attention.ATTENTION_NAME)
            ours.append(run_ponder(engine, problem, setup, seed + index))
            model_obj.set_attn_implementation("sdpa")
            baseline.append(run_baseline(engine, problem, setup, seed + index))
    finally:
        model_obj.set_attn_implementation(attention.ATTENTION_NAME)
    results = {"model": source.name, "threads": torch.get_num_threads(), "prompts": num_prompts,
               "n": setup.n, "beam_width": setup.beam_width, "max_steps": setup.max_steps,
               "max_step_tokens": setup.max_step_tokens, "max_tokens": setup.max_tokens,
               "temperature": setup.temperature, "verifier": "judge",
               "ponder": summarize(ours), "baseline": summarize(baseline)}
    results["decode_steps"] = decode_steps(model, PROBLEMS[:num_prompts], setup, seed)
    results["goodput_ratio"] = round(results["ponder"]["goodput_tok_s"] / results["baseline"]["goodput_tok_s"], 2)
    results["latency_ratio"] = round(results["baseline"]["latency_s"] / results["ponder"]["latency_s"], 2)
    return results


def decode_steps(model: str | None, problems, setup: Setup, seed: int) -> dict[str, list[dict]]:
    """Per problem, the decode steps of ponder's search with speculative extension off and on (an
    engine each), beside its longest path's tokens and the steps 16 plain streams take for its tokens."""
    runs: dict[str, list[dict]] = {}
    for speculative in (False, True):
        engine, _ = build_engine(RuntimeOptions(model=model, device="cpu", speculative_extension=speculative))
        steps, longest = StepLog(engine.runner), LongestPath(engine)
        per_problem = []
        for index, problem in enumerate(problems):
            before, longest.tokens = len(steps.decode), 0
            outcome = run_ponder(engine, problem, setup, seed + index)
            per_problem.append({"decode_steps": len(steps.decode) - before, "longest_path_tokens": longest.tokens,
                                "plain_16_steps": -(-outcome.tokens_generated // 16),
                                "seconds": round(outcome.seconds, 2), "answer": outcome.best_answer})
        runs["on" if speculative else "off"] = per_problem
    return runs


def table(results: dict) -> str:
    rows = [f"search benchmark: {results['model']}, {results['threads']} threads, {results['prompts']} prompts, "
            f"beam n={results['n']} width={results['beam_width']}, {results['max_steps']} steps of <= "
            f"{results['max_step_tokens']} tokens, max_tokens {results['max_tokens']}, judge verifier",
            f"{'system':<10} {'goodput tok/s':>14} {'latency s':>10} {'returned tok':>13} {'generated tok':>14} "
            f"{'gen prefill tok':>16} {'gen s':>8} {'verify s':>9} {'verify %':>9} {'verify prefill tok':>19}"]
    for name in ("ponder", "baseline"):
        s = results[name]
        rows.append(f"{name:<10} {s['goodput_tok_s']:>14.3f} {s['latency_s']:>10.2f} {s['tokens_returned']:>13.1f} "
                    f"{s['tokens_generated']:>14.1f} {s['generator_tokens_prefilled']:>16.1f} "
                    f"{s['seconds_generating']:>8.2f} {s['seconds_verifying']:>9.2f} "
                    f"{100 * s['verifier_share']:>8.1f}% {s['verifier_tokens_prefilled']:>19.1f}")
    rows.append(f"goodput ratio (ponder / baseline): {results['goodput_ratio']:.2f}x; "
                f"latency ratio (baseline / ponder): {results['latency_ratio']:.2f}x")
    rows.append("ponder decode steps per search (speculative extension off / on), longest path tokens, "
                "plain n=16 steps for as many tokens (off / on), seconds (off / on)")
    for index, (off, on) in enumerate(zip(results["decode_steps"]["off"], results["decode_steps"]["on"])):
        rows.append(f"  problem {index + 1}: {off['decode_steps']} / {on['decode_steps']} steps, longest path "
                    f"{off['longest_path_tokens']}, plain n=16 {off['plain_16_steps']} / {on['plain_16_steps']}, "
                    f"{off['seconds']} / {on['seconds']} s")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench search", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=3, help=f"problems to search, 1..{len(PROBLEMS)}")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="1 problem, 3 steps (a smoke run)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on shared cores, spinning OpenMP threads that lose "
                             "their core to another process slow every op down several-fold)")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    num_prompts = 1 if args.quick else args.prompts
    if not 1 <= num_prompts <= len(PROBLEMS):
        parser.error(f"--prompts must lie in 1..{len(PROBLEMS)}")
    max_steps = args.max_steps or (3 if args.quick else Setup.max_steps)
    with torch_threads(args.threads):
        results = run(args.model, num_prompts, Setup(max_steps=max_steps))
    emit(results, table(results), args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
