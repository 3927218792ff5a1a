"""SmolLM2-sized replicas of other families, to time the lean decoder on each against the same-sized llama.

    ponder bench family-replicas OUT_DIR [--families llama,qwen3,smollm3] [--dtype bfloat16]

Writes OUT_DIR/<family>: a random-weight (seeded) checkpoint of SmolLM2-135M's sizes (576 wide, 30
layers, 9 query heads and 3 KV heads of 64, MLP 1536, vocabulary 49152, tied embedding) in the family's
own transformers class (`qwen3`: per-head q/k norms, head_dim 64 given explicitly; `smollm3`: every
fourth layer without rotary; `qwen3_moe`: Qwen3's attention with every MLP routed over 8 experts, 2 a
token, each 768 wide, so a token's active MLP is SmolLM2's 1536; `gemma3_text`: Gemma 3's layers, head_dim 64
and query_pre_attn_scalar 64, five sliding layers (window 512) to a global one, GeGLU, its scaled
embedding; `qwen3_5`: Qwen3.5's text model, three Gated DeltaNet layers (3 key heads, 6 value heads of
64) to each gated full-attention one; `qwen3_5_moe`: the same layers, every MLP routed over 8 experts,
2 a token, beside the gated shared expert, each 512 wide; `gpt_oss`: gpt-oss's layers, biased projections, sinks, sliding and
full layers alternating (window 128), yarn rope (theta 150000, factor 2), every MLP routed over 8 biased experts with
the clamped SwiGLU, 2 a token, each 768 wide), saved as safetensors in `--dtype`, with SmolLM2's tokenizer read from the
embedded model's GGUF. Time them with `ponder bench decode --model OUT_DIR/<family>`; prints what it
wrote as JSON and a table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.report import emit

SIZES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
             rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = ("llama", "qwen3", "smollm3", "qwen3_moe", "gemma3_text", "qwen3_5", "qwen3_5_moe", "gpt_oss")
GEMMA3 = dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=512, sliding_window_pattern=6,
              hidden_activation="gelu_pytorch_tanh")
EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True)
# gpt-oss's published rope (its yarn factor that of the replica's 8192 positions, not 131072's 32) and
# window; its experts' width is `intermediate_size`
GPT_OSS = dict(head_dim=64, num_local_experts=8, num_experts_per_tok=2, intermediate_size=768, sliding_window=128,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 2.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})
# Qwen3.5's Gated DeltaNet (key and value heads one size, as llama.cpp reads them; fewer key heads, as published)
QWEN35 = dict(head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
              linear_num_key_heads=3, linear_num_value_heads=6)
# Qwen3.5-MoE's MLP: 2 of 8 routed experts and the gated shared one, each 512 wide (a token's active MLP SmolLM2's 1536)
QWEN35_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, shared_expert_intermediate_size=512)


def replica(family: str):
    """The family's transformers model at SmolLM2's sizes, seeded random weights (norms perturbed so
    none is the identity)."""
    import transformers as tf

    torch.manual_seed(0)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**SIZES))
    elif family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**SIZES, head_dim=64))
    elif family == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**SIZES, head_dim=64, **EXPERTS))
    elif family == "smollm3":
        model = tf.SmolLM3ForCausalLM(tf.SmolLM3Config(**SIZES))
    elif family == "qwen3_5":  # (three Gated DeltaNet layers to a full-attention one; its (1 + w) norms)
        sizes = {k: v for k, v in SIZES.items() if k != "rope_theta"}
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**sizes, **QWEN35))
    elif family == "qwen3_5_moe":
        sizes = {k: v for k, v in SIZES.items() if k not in ("rope_theta", "intermediate_size")}
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**sizes, **QWEN35, **QWEN35_EXPERTS))
    elif family == "gpt_oss":
        sizes = {k: v for k, v in SIZES.items() if k not in ("rope_theta", "intermediate_size")}
        model = tf.GptOssForCausalLM(tf.GptOssConfig(**sizes, **GPT_OSS))
    elif family == "gemma3_text":  # (its own rope bases: 1e6 global, 1e4 sliding)
        sizes = {k: v for k, v in SIZES.items() if k != "rope_theta"}
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**sizes, **GEMMA3))
    else:
        raise ValueError(f"no replica of {family!r}: one of {', '.join(FAMILIES)}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # (Gemma's norms multiply by 1 + w)
                offset = family in ("gemma3_text", "qwen3_5", "qwen3_5_moe") and "linear_attn" not in name
                param.uniform_(-0.2, 0.2) if offset else param.uniform_(0.8, 1.2)
    return model.eval()


def write(family: str, directory: Path, dtype: torch.dtype) -> dict:
    from transformers import AutoTokenizer

    from runtime.model.loader import default_model_path

    model = replica(family).to(dtype)
    model.save_pretrained(directory, safe_serialization=True)
    gguf = default_model_path()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(directory)
    return {"family": family, "path": str(directory), "dtype": str(dtype).removeprefix("torch."),
            "parameters": sum(p.numel() for p in model.parameters())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args(argv)
    rows = [write(f, Path(args.out_dir) / f, getattr(torch, args.dtype)) for f in args.families.split(",")]
    lines = [f"{'family':10} {'dtype':9} {'parameters':>11}  path"]
    lines += [f"{r['family']:10} {r['dtype']:9} {r['parameters']:>11,}  {r['path']}" for r in rows]
    emit({"replicas": rows}, "\n".join(lines), None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
