"""The benchmarks' one preamble over the served engine: load a model once, build engines over it
(a compute pool, a host tier and a disk tier), and drive a request through the engine's public
interface, `add_request` then `step` until idle, reading what `runtime_stats` counts.

Every KV benchmark (`kv`, `headwise`, `serving`, `simulate`) measures the engine users run: a policy
or a budget is a setting of `EngineConfig`, never a second executor.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.threads import torch_threads
from runtime.model import attention
from runtime.bootstrap import tier_chain
from runtime.engine import Engine, EngineConfig
from runtime.kv.kv_tiers import TieredPrefixCache
from runtime.kv.residency import tier_payload
from storage.kv_cache import kv_shape_of
from runtime.model.loader import load_causal_lm, load_tokenizer, pick_device, pick_dtype, resolve_model
from runtime.wire.params import SamplingParams, SearchParams
from runtime.wire.protocol import Delta, Finished, GenerateRequest, RequestError

QUESTION = (
    "A bakery sells muffins for $3 and cookies for $1.50. On Monday it sold 48 muffins and twice "
    "as many cookies. On Tuesday it sold 25% fewer muffins and 30 more cookies than on Monday. "
    "A muffin costs $1.20 to make, a cookie $0.40, and rent and wages are $95 a day. What was the "
    "profit over the two days? Think step by step and end with 'The answer is: X'.")
# Steps end at `max_step_tokens`: a delimiter no tokenizer here emits makes every step that long.
FIXED_STEP_DELIMITER = "\u241e\u241e"


@dataclass(frozen=True)
class Loaded:
    model: object
    tokenizer: object
    name: str
    key: bytes  # names this model's KV blocks in every tier

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def load(model: str | None = None, device: str = "cpu", dtype: str = "auto") -> Loaded:
    """The model (default: the embedded SmolLM2-135M-Instruct) and its tokenizer, as the runtime loads them."""
    source = resolve_model(model)
    torch_device = pick_device(device)
    torch_dtype = pick_dtype(dtype, torch_device)
    tokenizer = load_tokenizer(source)
    lm = load_causal_lm(source, torch_device, torch_dtype, attention.register())
    key = f"{source.name}|{torch_dtype}|{source.directory}|{source.gguf_file}".encode()
    return Loaded(lm, tokenizer, source.name, key)


def tiny_random(directory: Path, layers: int = 4, seed: int = 0) -> Loaded:
    """A random llama (hidden size 64) with the embedded model's tokenizer, saved and loaded as
    ponder loads models: a search on it runs the engine's real code at a fraction of the cost."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer(resolve_model(None))
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    lm = LlamaForCausalLM(config)
    with torch.no_grad():
        lm.lm_head.weight.mul_(8.0)  # sharper than uniform, like a trained model's logits
    lm.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    loaded = load(str(directory))
    return Loaded(loaded.model, loaded.tokenizer, f"random llama ({layers} layers, hidden 64)", loaded.key)


def prompt_ids(tokenizer, length: int) -> list[int]:
    """The chat-formatted question, its last `length` tokens (repeated if it is shorter)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                        tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    while len(ids) < length:
        ids = ids + ids
    return ids[-length:]


@dataclass(frozen=True)
class Tiers:
    host_bytes: int  # 0: no host tier, evicted blocks go straight to disk
    disk_dir: str | None  # None: no disk tier
    disk_bytes: int = 8 << 30
    uncached_reads: bool = True  # disk reads past the page cache (storage.uncached_io)


def block_bytes(loaded: Loaded, block_size: int) -> int:
    return kv_shape_of(loaded.model.config, block_size).bytes_per_block(next(loaded.model.parameters()).dtype)


def make_engine(loaded: Loaded, *, policy: str, num_blocks: int, block_size: int = 16, tiers: Tiers | None = None,
                max_num_seqs: int = 64, batch_invariant: bool = True, speculative_extension: bool = False,
                kv_granularity: str = "block", max_model_len: int | None = None) -> Engine:
    """A fresh engine over the loaded model. Batch invariance is on by default: tokens must not depend
    on how a policy batches the paths, so that outputs can be compared across policies with `==`."""
    text_config = loaded.model.config.get_text_config()
    config = EngineConfig(max_model_len=max_model_len or getattr(text_config, "max_position_embeddings", None) or 2048,
                          num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max(2048, block_size), policy=policy,
                          speculative_extension=speculative_extension, batch_invariant=batch_invariant,
                          kv_granularity=kv_granularity)
    chain = None
    if tiers is not None:
        parameter = next(loaded.model.parameters())
        chain = tier_chain(tier_payload(kv_shape_of(loaded.model.config, block_size), policy), parameter.dtype,
                           parameter.device, loaded.key, tiers.host_bytes, tiers.disk_dir, tiers.disk_bytes,
                           uncached_reads=tiers.uncached_reads)
    return Engine(loaded.model, loaded.tokenizer, config, loaded.key, tiers=chain)


def moved_bytes(run: "Run", compute: str) -> dict[str, int]:
    """A run's bytes as {"src->dst": bytes}, the engine's own tier (`compute`: "cpu" or "gpu") named
    "compute"."""
    def name(tier: str) -> str:
        return "compute" if tier == compute else tier

    return {"->".join(name(t) for t in pair.split("/")): n for pair, n in run.transfer_bytes.items()}


def release(engine: Engine) -> None:
    """Stop the engine's transfer worker without persisting its blocks (a benchmark's disk is
    thrown away)."""
    residency = engine.residency
    if isinstance(residency, TieredPrefixCache):
        residency.transfers.close()
    elif residency is not None:
        residency.close()


def fixed_step_search(prompt: list[int], *, paths: int, width: int, steps: int, step_tokens: int,
                      seed: int = 0, request_id: str = "bench") -> GenerateRequest:
    """Step-wise beam search as the paper runs it: `paths` kept, `width` children each, every step
    exactly `step_tokens` long (EOS ignored), scored by the model's own confidence, with no greedy
    anchor beside its paths; every final path is returned, so whole outputs can be compared."""
    return GenerateRequest(
        request_id=request_id, endpoint="completion", prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(max_tokens=steps * step_tokens, temperature=0.8, seed=seed, n=paths, ignore_eos=True),
        search=SearchParams(strategy="beam", n=paths, beam_width=width, max_steps=steps, max_step_tokens=step_tokens,
                            step_delimiter=FIXED_STEP_DELIMITER, verifier="confidence", greedy_anchor=False))


@dataclass
class Run:
    """One request on one engine, from the outside."""
    seconds: float
    outputs: tuple[tuple[int, ...], ...]  # every returned choice's tokens, by index
    tokens_generated: int
    peak_used_blocks: int  # the most compute-pool blocks in use after any step
    transfer_bytes: dict[str, int]  # "src/dst" -> bytes, nonzero pairs only
    stall_seconds: float  # the engine's own count of its waits on tier transfers
    finished: Finished | None = None
    error: RequestError | None = None


def drive(engine: Engine, request: GenerateRequest, on_step=None) -> Run:
    """Add `request`, step until the engine is idle; `on_step(engine)` after every step."""
    before = engine.runtime_stats()
    bytes_before = engine.transfer_bytes()
    used_key = ("gpu" if engine.device.type == "cuda" else "cpu") + "/used"
    peak = 0
    started = time.perf_counter()
    messages = list(engine.add_request(request))
    while engine.has_work:
        messages += engine.step()
        peak = max(peak, engine.runtime_stats().kv_blocks.get(used_key, 0))
        if on_step is not None:
            on_step(engine)
    seconds = time.perf_counter() - started
    after = engine.runtime_stats()
    outputs: dict[int, list[int]] = {}
    finished = error = None
    for m in messages:
        if isinstance(m, Delta) and m.token_ids:
            outputs.setdefault(m.index, []).extend(m.token_ids)
        elif isinstance(m, Finished):
            finished = m
        elif isinstance(m, RequestError):
            error = m
    moved = {k: v - bytes_before.get(k, 0) for k, v in engine.transfer_bytes().items()}
    return Run(seconds, tuple(tuple(outputs[i]) for i in sorted(outputs)),
               after.tokens_generated - before.tokens_generated, peak, {k: v for k, v in moved.items() if v},
               engine.transfer_stall_seconds(), finished, error)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every engine benchmark takes: the model, where the disk tier goes and how it reads."""
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--disk-dir", default=None, help="where the disk tier's files go (default: the temp dir)")
    parser.add_argument("--page-cache-reads", action="store_true",
                        help="read the disk tier through the page cache (default: past it)")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="compute threads (default: all cores but one, left to transfers)")


def with_model(args, name: str, measure):
    """`measure(loaded, args, workdir)` with the model loaded (`--quick`: a random llama) and a private
    working directory under `--disk-dir` for the disk tiers, removed afterwards."""
    with torch_threads(args.threads), tempfile.TemporaryDirectory(prefix=f"ponder-bench-{name}-",
                                                                  dir=args.disk_dir) as workdir:
        loaded = tiny_random(Path(workdir) / "model") if args.quick else load(args.model, args.device)
        return measure(loaded, args, workdir)
