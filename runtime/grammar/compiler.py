"""Turning a request's `Constraint` or `ToolCalling` into a compiled grammar, with llguidance.

llguidance was chosen over xgrammar by measurement on the embedded model's tokenizer (AVX512-VNNI,
see docs/structured-outputs.md): a JSON schema compiles in about 1 ms against xgrammar's 66 ms
cold, a mask costs 30-40 us a token (xgrammar 12-14 us, both under 1 % of a decode step here), its
matchers copy (`deep_copy`) and roll back, which a search's forks need, and it depends on nothing
(xgrammar needs torch's triton).

A compiled grammar is a pristine matcher kept per grammar text; each sequence starts from a copy.
Compilation runs on a worker thread (llguidance drops the GIL while it builds a grammar), so a heavy
schema never stalls the other requests' tokens; `GrammarCompiler.get` answers at once from the cache.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf
from llguidance import LLMatcher

from runtime.grammar.schema import ANY_OBJECT, JSON_STYLE, tightened
from runtime.grammar.tools import ToolFormat, tool_grammar
from runtime.wire.params import Constraint, ToolCalling

CACHE_SIZE = 256  # compiled grammars kept, least recently used first out


class GrammarError(ValueError):
    """The client's schema, regex, grammar or tool definition does not compile: a 400 naming `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def grammar_text(constraint: Constraint | None, tools: ToolCalling | None, tool_format: ToolFormat) -> str:
    """The llguidance grammar a request's output must match (GrammarError when it cannot be built)."""
    if tools is not None:
        return LLMatcher.grammar_from_lark(tool_grammar(tools, tool_format, JSON_STYLE))
    assert constraint is not None
    kind, spec, param = constraint.kind, constraint.spec, constraint.param
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema(tightened(ANY_OBJECT), defaults=JSON_STYLE)
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}", param) from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object (or true/false)", param)
        try:
            return LLMatcher.grammar_from_json_schema(tightened(schema) if isinstance(schema, dict) else {}
                                                      if schema else {"not": {}}, defaults=JSON_STYLE)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema cannot be compiled: {exc}", param) from None
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "grammar":
        try:
            return llguidance.grammar_from("grammar", spec)
        except ValueError as exc:
            raise GrammarError(f"the grammar cannot be read as Lark or GBNF: {exc}", param) from None
    raise GrammarError(f"unknown constraint kind {kind!r}", param)


class GrammarCompiler:
    """The model's tokenizer as llguidance sees it, and the grammars compiled for it so far."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int], tool_format: ToolFormat) -> None:
        # The mask covers the model's logits (a padded head has more columns than the tokenizer has tokens).
        # llguidance reads a fast tokenizer whose tokens are byte strings (BPE, byte-level or SentencePiece);
        # for another (WordPiece joins tokens with spaces) a constrained request is a 400 saying why.
        self.unavailable: str | None = None
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(vocab_size, len(tokenizer)),
                                                          eos_token=sorted(eos_ids) or None)
        except (ValueError, TypeError) as exc:
            self.unavailable = f"constrained decoding cannot read this model's tokenizer ({exc})"
        self.vocab_size = vocab_size
        self.num_words = (self.tokenizer.vocab_size + 31) // 32 if self.unavailable is None else 0
        self.tool_format = tool_format
        self.cache: OrderedDict[str, LLMatcher] = OrderedDict()
        self.pending: dict[str, Future] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ponder-grammar")
        self.stats = {"compiled": 0, "cache_hits": 0}

    def key(self, constraint: Constraint | None, tools: ToolCalling | None) -> tuple[str, str]:
        """(grammar text, the request field it came from); GrammarError for what cannot become a grammar."""
        param = "tools" if tools is not None else constraint.param  # type: ignore[union-attr]
        if self.unavailable is not None:
            raise GrammarError(self.unavailable, param)
        return grammar_text(constraint, tools, self.tool_format), param

    def get(self, text: str) -> LLMatcher | None:
        """The compiled grammar for `text`, if it is cached."""
        matcher = self.cache.get(text)
        if matcher is not None:
            self.cache.move_to_end(text)
            self.stats["cache_hits"] += 1
        return matcher

    def submit(self, text: str, param: str) -> Future:
        """Compile `text` on the worker thread; the future's result is the pristine matcher, or a
        GrammarError. The caller hands a finished future to `store` (the cache is the loop's alone)."""
        future = self.pending.get(text)
        if future is None:
            future = self.pool.submit(self._compile, text, param)
            self.pending[text] = future
        return future

    def store(self, text: str, future: Future) -> LLMatcher:
        """A finished compilation into the cache; raises its GrammarError."""
        self.pending.pop(text, None)
        matcher = future.result()
        if text not in self.cache:
            self.stats["compiled"] += 1
        self.cache[text] = matcher
        self.cache.move_to_end(text)
        while len(self.cache) > CACHE_SIZE:
            self.cache.popitem(last=False)
        return matcher

    def compile_now(self, text: str, param: str) -> LLMatcher:
        """Compile on this thread and cache (tests, benchmarks); raises GrammarError."""
        future: Future = Future()
        try:
            future.set_result(self._compile(text, param))
        except GrammarError as exc:
            future.set_exception(exc)
        return self.store(text, future)

    def _compile(self, text: str, param: str) -> LLMatcher:
        matcher = LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()), param)
        return matcher

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _first_line(error: str) -> str:
    lines = [line for line in error.splitlines() if line.strip()]
    return " ".join(lines[:3])[:500] or "the grammar does not compile"
