"""A live `ponder serve` for the benchmarks and the tests that talk to one: a tiny random Llama to serve,
a free loopback port, the server started and stopped, and polling until it is ready."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def build_tiny_model(directory: Path) -> Path:
    """A 2-layer random Llama with a word-level tokenizer over `w0`..`w59` and a chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(60)] + ["\n", "\n\n", ".", "0", "1", "2"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False))
    model.save_pretrained(directory, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    fast.save_pretrained(directory)
    return directory


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 20 s."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_until(proc: subprocess.Popen, name: str, log_path: Path, ready, timeout_s: float,
               interval_s: float = 0.2) -> None:
    """Poll `ready()` (an HTTP error or a bad body counts as not yet) until it is true; raise, with the
    tail of its log, if `proc` exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited early:\n{log_path.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if ready():
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} was not ready within {timeout_s:.0f} s:\n{log_path.read_text()[-4000:]}")
        time.sleep(interval_s)


@contextlib.contextmanager
def serve(model: Path, log_path: Path, device: str = "auto", env: dict | None = None,
          timeout_s: float = 300.0, dtype: str | None = None) -> Iterator[str]:
    """`ponder serve` on a free loopback port; yields its base URL once /health is 200. `dtype`: its
    `--dtype` (None: the settings' own)."""
    port = free_port()
    full_env = {**os.environ, "PONDER_SERVER__STATS_INTERVAL_S": "0.2", "PONDER_SERVER__LOG_LEVEL": "WARNING",
                **(env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port), "--model", str(model), "--device", device,
                                 *(["--dtype", dtype] if dtype else [])],
                                cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(proc, "the server", log_path, lambda: httpx.get(base + "/health", timeout=2).status_code == 200,
                   timeout_s)
        yield base
    finally:
        stop(proc)
