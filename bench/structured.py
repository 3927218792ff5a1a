"""What a JSON schema costs: decode tokens/s with a schema against the same request without one, and
the time to compile a schema cold and cached.

    ponder bench structured [--model PATH] [--tokens N] [--parallel N] [--repeats N] [--anchor NAME=URL ...]
                            [--json PATH]

In process, on the engine (default settings): one greedy stream and one request of `--parallel`
sampled choices (default 16), each decoding `--tokens` tokens (default 64, EOS ignored) after the
first, with and without `SCHEMA` (a list of at least 64 notes: it cannot be complete within the run,
so every step computes a real mask). The two cases alternate, each repeat; each figure is the best
of `--repeats` (default 3). Compile: a schema never seen (cold; a property name changes each time)
and the same schema again (cached: the compiled grammar is looked up), median of 20.

`--libraries`: llguidance (ponder's) against xgrammar, where it is importable (`pip install --no-deps
xgrammar apache-tvm-ffi`), on the model's tokenizer: compiling the person schema cold, and a mask plus a
token per token over a valid output (median of 5 passes).

`--anchor NAME=URL`: an OpenAI-compatible server (llama.cpp's llama-server, vLLM's CPU build, or a
ponder) asked the same schema request (chat, `response_format` json_schema with a small person
schema, 8 requests): how many outputs validate and the tokens/s it streamed them at.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.decode import chat_prompt_ids
from bench.report import emit, kernel_isa
from runtime.bootstrap import build_engine
from runtime.wire.params import Constraint, SamplingParams
from runtime.wire.protocol import GenerateRequest
from runtime.wire.options import RuntimeOptions

SCHEMA = {"type": "object", "properties": {"notes": {
    "type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 64}}, "required": ["notes"]}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}
PROMPT = [{"role": "user", "content": "Take notes on the history of the bicycle, as JSON."}]


def _request(prompt_ids: list[int], n: int, tokens: int, constrained: bool) -> GenerateRequest:
    return GenerateRequest(request_id=f"structured-{n}-{constrained}-{time.monotonic_ns()}", endpoint="completion",
                           prompt_token_ids=tuple(prompt_ids),
                           sampling=SamplingParams(max_tokens=tokens + 1, temperature=0.0 if n == 1 else 0.8, n=n,
                                                   seed=0, ignore_eos=True),
                           constraint=Constraint(kind="json_schema", spec=json.dumps(SCHEMA)) if constrained else None)


def decode_rate(engine, prompt_ids: list[int], n: int, tokens: int, constrained: bool) -> float:
    """Tokens/s after the first token (the prefill's), with or without the schema."""
    request = _request(prompt_ids, n, tokens, constrained)
    out = engine.add_request(request)
    while not out:  # the grammar compiling (cached after the first time)
        out = engine.step()
    engine.step()  # prefill and the first token of every choice
    start, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    return steps * n / (time.perf_counter() - start)


def compile_seconds(engine, repeats: int = 20) -> dict:
    grammars = engine.gate.grammars
    cold, cached = [], []
    for i in range(repeats):
        schema = {**PERSON, "properties": {**PERSON["properties"], f"field_{time.monotonic_ns()}_{i}": {"type": "string"}}}
        constraint = Constraint(kind="json_schema", spec=json.dumps(schema))
        start = time.perf_counter()
        text, param = grammars.key(constraint, None)
        grammars.compile_now(text, param)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        text, param = grammars.key(constraint, None)
        assert grammars.get(text) is not None
        cached.append(time.perf_counter() - start)
    return {"cold_ms": statistics.median(cold) * 1e3, "cached_ms": statistics.median(cached) * 1e3}


def libraries(tokenizer) -> dict:
    """Compile and per-token mask times of llguidance and (where installed) xgrammar, same schema and text."""
    import llguidance.hf
    import llguidance.torch as llg_torch
    from llguidance import LLMatcher

    text = '{"name": "Alec Smith", "age": 20}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = {}
    llg = llguidance.hf.from_tokenizer(tokenizer)
    grammar = LLMatcher.grammar_from_json_schema(PERSON)
    start = time.perf_counter()
    LLMatcher(llg, grammar)
    compile_ms = (time.perf_counter() - start) * 1e3
    bits = llg_torch.allocate_token_bitmask(1, llg.vocab_size)

    def llg_pass() -> float:
        matcher, start = LLMatcher(llg, grammar), time.perf_counter()
        for token in ids:
            llg_torch.fill_next_token_bitmask(matcher, bits, 0)
            matcher.consume_token(token)
        return (time.perf_counter() - start) / len(ids) * 1e6

    out["llguidance"] = {"compile_ms": compile_ms, "mask_us": statistics.median(llg_pass() for _ in range(5))}
    try:
        import xgrammar
    except ImportError as exc:
        out["xgrammar"] = {"skipped": f"not importable: {exc}"}
        return out
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgrammar.GrammarCompiler(info)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(PERSON))
    compile_ms = (time.perf_counter() - start) * 1e3
    xbits = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def xgr_pass() -> float:
        matcher, start = xgrammar.GrammarMatcher(compiled), time.perf_counter()
        for token in ids:
            matcher.fill_next_token_bitmask(xbits, 0)
            matcher.accept_token(token)
        return (time.perf_counter() - start) / len(ids) * 1e6

    out["xgrammar"] = {"compile_ms": compile_ms, "mask_us": statistics.median(xgr_pass() for _ in range(5))}
    return out


def anchor(name: str, url: str, model: str | None, count: int = 8) -> dict:
    """The person-schema request against an OpenAI-compatible server: valid outputs and tokens/s."""
    import httpx
    import jsonschema

    valid, tokens, seconds = 0, 0, 0.0
    for i in range(count):
        body = {"model": model or "default", "messages": [{"role": "user", "content": "Make up a person."}],
                "max_tokens": 64, "temperature": 0.8, "seed": i,
                "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
        start = time.perf_counter()
        answer = httpx.post(url.rstrip("/") + "/v1/chat/completions", json=body, timeout=300).json()
        seconds += time.perf_counter() - start
        tokens += answer.get("usage", {}).get("completion_tokens", 0)
        try:
            jsonschema.validate(json.loads(answer["choices"][0]["message"]["content"]), PERSON)
            valid += 1
        except (ValueError, KeyError, jsonschema.ValidationError):
            pass
    return {"name": name, "url": url, "valid": valid, "requests": count, "tokens_per_s": tokens / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench structured", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file or model directory (default: the embedded model)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--libraries", action="store_true", help="time llguidance against xgrammar too")
    parser.add_argument("--anchor", action="append", default=[], metavar="NAME=URL")
    parser.add_argument("--anchor-model", default=None, help="the model name the anchors serve")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    engine, source = build_engine(RuntimeOptions(model=args.model, device="cpu"))
    prompt_ids = chat_prompt_ids(engine.tokenizer, PROMPT)
    rows = []
    for n in (1, args.parallel):
        best = {False: 0.0, True: 0.0}
        for _ in range(max(1, args.repeats)):
            for constrained in (False, True):  # alternating, so a noisy neighbour hits both
                best[constrained] = max(best[constrained], decode_rate(engine, prompt_ids, n, args.tokens, constrained))
        rows.append({"streams": n, "plain_tokens_per_s": best[False], "schema_tokens_per_s": best[True],
                     "ratio": best[True] / best[False]})
    results = {"model": source.name, "kernel_isa": kernel_isa(), "tokens": args.tokens, "decode": rows,
               "compile": compile_seconds(engine), "anchors": [anchor(*a.split("=", 1), args.anchor_model)
                                                               for a in args.anchor]}
    if args.libraries:
        results["libraries"] = libraries(engine.tokenizer)
    lines = [f"ponder bench structured: {source.name}, int4 kernel {results['kernel_isa']}, {args.tokens} tokens",
             f"{'streams':>8} {'plain tok/s':>12} {'schema tok/s':>13} {'ratio':>6}"]
    lines += [f"{r['streams']:>8} {r['plain_tokens_per_s']:>12.1f} {r['schema_tokens_per_s']:>13.1f} {r['ratio']:>6.2f}"
              for r in rows]
    lines.append(f"compile a schema: cold {results['compile']['cold_ms']:.2f} ms, cached "
                 f"{results['compile']['cached_ms']:.3f} ms")
    lines += [f"{name}: " + (", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
              for name, row in results.get("libraries", {}).items()]
    lines += [f"anchor {a['name']}: {a['valid']}/{a['requests']} valid, {a['tokens_per_s']:.1f} tok/s"
              for a in results["anchors"]]
    emit(results, "\n".join(lines), args.json)
    return 0


if __name__ == "__main__":
    main()
