"""Head-wise KV offloading (HeadInfer) of one long sequence: a compute tier of a small share of the
sequence's KV, the rest in the host tier (and, with --host-fraction below 1, on disk).

    ponder bench headwise [--quick] [--json PATH] [--prompt N] [--tokens N] [--budget-fraction F]

Decodes `--tokens` greedy tokens after a `--prompt`-token prompt three ways: transformers'
`generate` (sdpa, its own resident cache), the head-wise path with every piece resident, and the
head-wise path within the budget; reports the bytes moved per tier pair, seconds, tokens/s, the
share of time stalled on loads and whether all three decoded the same tokens. `--quick` runs a
tiny random llama built in a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.kv import default_model, prompt_ids
from bench.report import emit
from bench.threads import torch_threads
from runtime.offload.headwise import HeadwiseReport, HeadwiseSpec, generate_headwise


def tiny_model(directory: Path, seed: int = 0):
    """A random 8-layer llama with 4 KV heads (32 slices), loaded the way ponder loads models."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from runtime import attention
    from runtime.loader import ModelSource, load_causal_lm

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper than uniform, like a trained model's logits
    model.save_pretrained(directory, safe_serialization=True)
    return load_causal_lm(ModelSource("tiny-llama", str(directory)), torch.device("cpu"),
                          torch.float32, attention.register()), "tiny-llama (random, 8 layers, 4 KV heads)"


def hf_generate(model, prompt: list[int], tokens: int) -> dict:
    """Greedy `generate` with sdpa; decode time is the run less a one-token run (the prefill)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    try:
        with torch.inference_mode():
            began = time.perf_counter()
            model.generate(ids, max_new_tokens=1, **kwargs)
            prefill = time.perf_counter() - began
            began = time.perf_counter()
            out = model.generate(ids, max_new_tokens=tokens, **kwargs)
            seconds = time.perf_counter() - began
    finally:
        model.set_attn_implementation(previous)
    decode = max(seconds - prefill, 1e-9)
    return {"tokens": out[0, len(prompt):].tolist(), "seconds": round(seconds, 3),
            "prefill_seconds": round(prefill, 3),
            "tokens_per_s": round((tokens - 1) / decode, 2) if tokens > 1 else None}


def _summary(r: HeadwiseReport, new_tokens: int) -> dict:
    decode_loads = r.loads_per_forward[len(r.loads_per_forward) - (new_tokens - 1):] \
        if new_tokens > 1 else []
    return {"budget_pieces": r.budget_pieces, "resident_pieces": r.resident_pieces,
            "compute_bytes": r.compute_bytes, "pieces_loaded": r.pieces_loaded,
            "pieces_written": r.pieces_written,
            "pieces_loaded_per_decoded_token": (sum(decode_loads) / len(decode_loads)
                                                if decode_loads else 0),
            "bytes_moved": {k: v for k, v in r.bytes_moved.items() if v},
            "bytes_in": r.bytes_in, "bytes_out": r.bytes_out,
            "prefill_seconds": round(r.prefill_seconds, 3),
            "decode_seconds": round(r.decode_seconds, 3), "seconds": round(r.seconds, 3),
            "tokens_per_s": round((new_tokens - 1) / r.decode_seconds, 2)
            if new_tokens > 1 and r.decode_seconds > 0 else None,
            "stall_seconds": round(r.stall_seconds, 3),
            "stall_share": round(r.stall_seconds / r.seconds, 4) if r.seconds > 0 else 0.0,
            "writeback_seconds": round(r.writeback_seconds, 3)}


def run(args) -> dict:
    with torch_threads(args.threads), tempfile.TemporaryDirectory(prefix="ponder-bench-headwise-") as workdir:
        return _run(args, workdir)


def _run(args, workdir: str) -> dict:
    if args.quick:
        (model, model_name), tokenizer = tiny_model(Path(workdir) / "model"), None
    else:
        model, model_name, tokenizer = default_model(args.device)
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = prompt_ids(tokenizer, vocab, args.prompt)
    config = model.config.get_text_config()
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    slices = layers * kv_heads // args.group_heads
    max_tokens = len(prompt) + args.tokens - 1
    staging = -(-max_tokens // args.block_size)
    total_pieces = slices * staging
    piece_bytes = 2 * args.group_heads * args.block_size * head_dim * \
        torch.empty((), dtype=next(model.parameters()).dtype).element_size()
    budget = args.budget_pieces or int(total_pieces * args.budget_fraction)
    host_bytes = int(total_pieces * args.host_fraction) * piece_bytes
    common = dict(block_size=args.block_size, group_heads=args.group_heads,
                  prefill_chunk=args.chunk, prefetch=not args.no_prefetch)
    tiers = HeadwiseSpec(budget_pieces=budget, host_bytes=host_bytes, disk_dir=workdir,
                         disk_bytes=max(64 << 20, 2 * total_pieces * piece_bytes), **common)
    # Every piece resident: room for them all, the tails and the staging buffers.
    everything = HeadwiseSpec(budget_pieces=total_pieces + slices + 2 * staging, **common)
    key = model_name.encode()
    generate_headwise(model, prompt[:args.block_size * 2 + 1], 2, everything, model_key=key)  # warm-up
    load_before = os.getloadavg()[0]
    reference = hf_generate(model, prompt, args.tokens)
    print(f"# transformers generate: {reference['seconds']:.1f} s", file=sys.stderr)
    resident = generate_headwise(model, prompt, args.tokens, everything, model_key=key)
    print(f"# head-wise, all resident: {resident.seconds:.1f} s", file=sys.stderr)
    offloaded = generate_headwise(model, prompt, args.tokens, tiers, model_key=key)
    print(f"# head-wise, {budget} of {total_pieces} pieces: {offloaded.seconds:.1f} s",
          file=sys.stderr)
    return {
        "model": model_name, "device": str(device), "threads": args.threads,
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "prompt_tokens": len(prompt), "new_tokens": args.tokens, "block_size": args.block_size,
        "prefill_chunk": args.chunk, "layers": layers, "kv_heads": kv_heads,
        "group_heads": args.group_heads, "slices": slices, "prefetch": not args.no_prefetch,
        "piece_bytes": piece_bytes, "total_kv_pieces": total_pieces,
        "total_kv_bytes": total_pieces * piece_bytes,
        "budget_pieces": budget, "budget_bytes": budget * piece_bytes,
        "budget_fraction": round(budget / total_pieces, 4), "host_bytes": host_bytes,
        "disk_tier": host_bytes < total_pieces * piece_bytes,
        "offloaded": _summary(offloaded, args.tokens),
        "resident": _summary(resident, args.tokens),
        "transformers_generate": {k: v for k, v in reference.items() if k != "tokens"},
        "outputs_identical": offloaded.tokens == resident.tokens == reference["tokens"],
        "tokens": offloaded.tokens,
    }


def table(r: dict) -> str:
    off, res, hf = r["offloaded"], r["resident"], r["transformers_generate"]
    mib = 2 ** 20
    rows = [f"head-wise offload benchmark: {r['model']} on {r['device']} ({r['threads']} compute "
            f"threads, load average {r['load_average'][0]}), prompt {r['prompt_tokens']}, "
            f"{r['new_tokens']} new tokens, {r['slices']} slices (layer x KV-head group)",
            f"compute tier {r['budget_pieces']} of {r['total_kv_pieces']} pieces "
            f"({r['budget_bytes'] / mib:.1f} of {r['total_kv_bytes'] / mib:.1f} MiB, "
            f"{r['budget_fraction']:.1%}; {off['resident_pieces']} resident), host tier "
            f"{r['host_bytes'] / mib:.1f} MiB" + (", the rest on disk" if r["disk_tier"] else ""),
            f"{'run':<24} {'MiB in':>9} {'MiB out':>8} {'prefill s':>10} {'decode s':>9} "
            f"{'tok/s':>7} {'stall':>6}"]
    for name, s in (("head-wise, offloaded", off), ("head-wise, all resident", res)):
        rows.append(f"{name:<24} {s['bytes_in'] / mib:>9.1f} {s['bytes_out'] / mib:>8.1f} "
                    f"{s['prefill_seconds']:>10.2f} {s['decode_seconds']:>9.2f} "
                    f"{s['tokens_per_s'] or 0:>7.2f} {s['stall_share']:>6.1%}")
    rows.append(f"{'transformers generate':<24} {'-':>9} {'-':>8} {hf['prefill_seconds']:>10.2f} "
                f"{hf['seconds'] - hf['prefill_seconds']:>9.2f} {hf['tokens_per_s'] or 0:>7.2f} "
                f"{'-':>6}")
    rows.append("bytes moved: " + ", ".join(f"{k} {v / mib:.1f} MiB"
                                            for k, v in off["bytes_moved"].items()))
    rows.append(f"outputs identical (offloaded, resident, generate): {r['outputs_identical']}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench headwise", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny random llama, 512-token prompt (under a minute)")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (2048; quick 512)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens to decode (32; quick 16)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--group-heads", type=int, default=1, help="KV heads per group")
    parser.add_argument("--chunk", type=int, default=256, help="prompt tokens per prefill forward")
    parser.add_argument("--budget-fraction", type=float, default=None,
                        help="compute tier as a share of the sequence's KV (1/16; quick 1/8)")
    parser.add_argument("--budget-pieces", type=int, default=None,
                        help="compute tier in pieces (overrides --budget-fraction)")
    parser.add_argument("--host-fraction", type=float, default=1.0,
                        help="host tier as a share of the KV; below 1 the rest goes to disk")
    parser.add_argument("--no-prefetch", action="store_true",
                        help="one staging buffer, no load of the next slice during compute")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="compute threads (default: all cores but one, left to transfers)")
    args = parser.parse_args(argv)
    if args.prompt is None:
        args.prompt = 512 if args.quick else 2048
    if args.tokens is None:
        args.tokens = 16 if args.quick else 32
    if args.budget_fraction is None:
        args.budget_fraction = 1 / 8 if args.quick else 1 / 16
    results = run(args)
    emit(results, table(results), args.json_path, {k: v for k, v in results.items() if k != "tokens"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
