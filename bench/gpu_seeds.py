"""The seed papers' own figures on a GPU, for the device check (bench/gpu.py), each through the benchmark
that measures it on any device:

- LBS: step-wise beam search under one KV budget (a quarter of its distinct KV on the device, a host
  tier and disk for the rest), token-wise offload against locality-aware beam groups (bench.kv), on a
  random llama of Llama-3.2-1B's shapes;
- HeadInfer: one long request whose KV is ten times the device pool it gets, streamed head-wise, its
  tokens against the resident run's and transformers' `generate` (bench.headwise), on the 8B-shaped llama;
- FlashTTS: the search example with speculative beam extension off and on (bench.example), on a model
  of the embedded model's shapes saved with the tokenizer.

The models' weights are random (nothing is downloaded on a GPU machine): the searches' answers mean
nothing, their tokens are compared run against run, and their throughput is the figure. The tokenizer
is the embedded model's, read from `--tokenizer DIR` where its package is not installed.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench import served
from bench.gpu_models import EIGHT_B, LBS_SHAPES, SMOLLM2_135M, empty_cache, random_llama

# The workloads: (the device check's, its --dry-run's on tiny models)
LBS_WORK = (dict(prompt=512, paths=8, width=2, step=32, steps=6), dict(prompt=32, paths=4, width=2, step=8, steps=2))
HEADWISE_WORK = (dict(prompt=2048, tokens=16), dict(prompt=320, tokens=4))
EXAMPLE_MAX_TOKENS = (256, 24)


def tokenizer_from(directory: Path | None):
    """The tokenizer in `directory`, else the embedded model's (its package installed)."""
    from runtime.model.loader import load_tokenizer, resolve_model

    if directory is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory)
    return load_tokenizer(resolve_model(None))


def random_loaded(device: torch.device, shapes: dict, dtype: torch.dtype, tokenizer, name: str) -> served.Loaded:
    """A random llama of `shapes` with `tokenizer`'s vocabulary, attending as the runtime's models do."""
    from runtime.model import attention

    model = random_llama(device, {**shapes, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
                                  "eos_token_id": tokenizer.eos_token_id}, dtype)
    model.set_attn_implementation(attention.register())
    return served.Loaded(model, tokenizer, name, f"{name}|{dtype}".encode())


def _args(**values) -> argparse.Namespace:
    return argparse.Namespace(block_size=16, page_cache_reads=False, threads=torch.get_num_threads(), disk_dir=None,
                              **values)


def lbs(report: dict, device: torch.device, dtype: torch.dtype, tokenizer, shapes: dict = LBS_SHAPES,
        dry: bool = False) -> None:
    from bench import kv

    loaded = random_loaded(device, shapes, dtype, tokenizer, "random llama, Llama-3.2-1B's shapes")
    args = _args(**LBS_WORK[dry], seed=0, budget_fraction=0.25, host_fraction=0.25,
                 policies=["token", "lbs_no_prefix", "lbs"], repeat=1)
    with tempfile.TemporaryDirectory(prefix="ponder-gpu-lbs-") as workdir:
        result = kv.measure(loaded, args, workdir)
    report["lbs"] = {key: result[key] for key in ("model", "device", "workload", "distinct_kv_bytes", "budget_bytes",
                                                   "host_bytes", "policies", "outputs_identical", "speedup",
                                                   "speedup_no_prefix", "ratio_bytes") if key in result}
    if not result["outputs_identical"]:
        report["errors"].append("lbs: a policy's tokens differ from the resident run's")
    del loaded
    empty_cache()


def headwise(report: dict, device: torch.device, dtype: torch.dtype, tokenizer, shapes: dict = EIGHT_B,
             dry: bool = False) -> None:
    from bench import headwise as bench_headwise

    if dry:  # (enough layers and KV heads that a tenth of the blocks holds a slice's streaming buffers)
        shapes = {**shapes, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8}
    loaded = random_loaded(device, shapes, dtype, tokenizer, "random llama, Llama-3-8B's shapes")
    args = _args(**HEADWISE_WORK[dry], pool_fraction=0.1, host_fraction=0.5)
    with tempfile.TemporaryDirectory(prefix="ponder-gpu-headwise-") as workdir:
        result = bench_headwise.measure(loaded, args, workdir)
    report["headwise"] = {key: value for key, value in result.items() if key != "tokens"}
    if not result["outputs_identical"]:
        report["errors"].append("headwise: the offloaded tokens differ from the resident run's or generate's")
    del loaded
    empty_cache()


def flashtts(report: dict, device: torch.device, dtype: torch.dtype, tokenizer, shapes: dict = SMOLLM2_135M,
             dry: bool = False) -> None:
    from bench import example

    loaded = random_loaded(device, shapes, dtype, tokenizer, "random llama, SmolLM2-135M's shapes")
    with tempfile.TemporaryDirectory(prefix="ponder-gpu-example-") as directory:
        loaded.model.save_pretrained(directory, safe_serialization=True)
        tokenizer.save_pretrained(directory)
        del loaded
        empty_cache()
        runs = {str(on).lower(): example.run(directory, False, max_tokens=EXAMPLE_MAX_TOKENS[dry], speculative=on,
                                             device=device.type) for on in (False, True)}
    keep = ("seconds", "tokens_generated", "tok_s", "plain_16_tok_s", "vs_plain_16", "steps", "decode_steps",
            "speculative_tokens_used", "speculative_tokens_discarded", "speculative_tokens_adopted", "output_digest")
    report["flashtts"] = {"model": "random llama, SmolLM2-135M's shapes (the embedded tokenizer)",
                          "speculative_extension": {on: {k: r[k] for k in keep if k in r} for on, r in runs.items()}}
    off, on = runs["false"], runs["true"]
    report["flashtts"]["goodput_on_over_off"] = round(on["tok_s"] / off["tok_s"], 3) if off["tok_s"] else None
    report["flashtts"]["same_output"] = off["output_digest"] == on["output_digest"]
    if off["steps"] < 2:
        report["flashtts"]["note"] = ("the random model wrote no step delimiter inside max_tokens: one step, nothing "
                                      "for speculation to extend; this figure says nothing of FlashTTS")


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.gpu_seeds --save-tokenizer DIR`: the embedded model's tokenizer written to DIR, to
    carry to a GPU machine that has no network (`python -m bench.gpu --tokenizer DIR` there)."""
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_seeds", description=main.__doc__)
    parser.add_argument("--save-tokenizer", type=Path, required=True)
    args = parser.parse_args(argv)
    tokenizer_from(None).save_pretrained(args.save_tokenizer)
    print(f"the embedded model's tokenizer written to {args.save_tokenizer}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
