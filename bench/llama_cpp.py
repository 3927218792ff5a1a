"""llama.cpp on the same GGUF file, through `llama-cpp-python` (the optional `bench` extra).

Decodes one greedy stream from the same prompt token ids ponder gets. The high-level `Llama` API
decodes one sequence at a time, so there is no 16-stream figure for it here.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager


def unavailable() -> str | None:
    """Why llama.cpp cannot be measured here, or None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return (f"llama-cpp-python is not installed ({exc}); install the `bench` extra "
                "(see docs/benchmarks.md, decode)")
    return None


def weight_bytes(path: str) -> int:
    """Bytes a decode step reads: every tensor of the file (the tied head reads the embedding)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def tokens_per_s(path: str, prompt_ids: list[int], tokens: int, threads: int, repeats: int = 1) -> dict:
    """Greedy decode of `tokens` tokens after the prompt (the first, which costs the prefill, untimed):
    the fastest of `repeats` runs."""
    from llama_cpp import Llama

    with _quiet():
        # verbose=True: a build crashed without it on prompts longer than one token.
        llm = Llama(model_path=path, n_ctx=len(prompt_ids) + tokens + 16, n_threads=threads,
                    n_threads_batch=threads, n_batch=512, verbose=True, logits_all=False)
        try:
            _decode(llm, prompt_ids, 8)  # warm-up
            runs = [_decode(llm, prompt_ids, tokens) for _ in range(max(1, repeats))]
            return max(runs, key=lambda r: r["tokens_per_s"])
        finally:
            llm.close()


@contextmanager
def _quiet() -> Iterator[None]:
    """llama.cpp's verbose log goes to a temporary file instead of the benchmark's output."""
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _decode(llm, prompt_ids: list[int], tokens: int) -> dict:
    llm.reset()
    produced, start = 0, 0.0
    for _ in llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
        if produced == 0:
            start = time.perf_counter()
        produced += 1
        if produced == tokens:
            break
    seconds = time.perf_counter() - start
    return {"tokens": produced - 1, "seconds": seconds, "tokens_per_s": (produced - 1) / seconds}
