"""A tiny llama GGUF written with the `gguf` package: 4-bit linear layers and a Q8_0 embedding (tied
head), as llama.cpp's converter lays them out (q/k rows in its order), for the `quantize = auto` tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 96, 64, 2, 4, 2, 128
# Where each type gguf cannot quantize holds its float16 super-block scale(s); the rest of its block
# may be any bytes.
SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
                 "IQ2_XXS": (0,)}


def blocks_of(kind: str, rows: int, cols: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """`kind` data for a [rows, cols] tensor: gguf's quantizer where it has one, else random bytes in the
    type's block layout (every pattern of codes and sub-scales is a valid block) with float16
    super-block scales in [scale / 10, scale * 1.1)."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[kind]
    if kind not in SCALE_OFFSETS:
        return quantize((rng.standard_normal((rows, cols)) * 0.3).astype(np.float32), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[kind]:
        values = (rng.random((rows, cols // block)) * scale + scale / 10).astype(np.float16)
        data[..., offset:offset + 2] = values.view(np.uint8).reshape(rows, -1, 2)
    return data.reshape(rows, -1)


def write_tiny_vocabulary(writer: GGUFWriter, vocab: int, unk: bool = False) -> None:
    """The tests' tiny vocabulary in a GGUF's tokenizer metadata: `vocab` tokens `<t0>`, `<t1>`, ...
    (1 the first, 2 the last of a text); `unk`: token 0 is `<unk>` (Gemma's tokenizer wants one)."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list([b"<unk>" if unk and i == 0 else f"<t{i}>".encode() for i in range(vocab)])
    if unk:
        writer.add_unk_token_id(0)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([1] * vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_tiny_gguf(directory: Path, kind: str = "Q4_1", seed: int = 0, kinds: dict[str, str] | None = None,
                    hidden: int = HIDDEN, ffn: int = FFN, embedding: str = "Q8_0", arch: str = "llama",
                    head_dim: int | None = None, head: str | None = None) -> Path:
    """`directory`/tiny.gguf with every projection stored as `kind`, but those named in `kinds` (e.g.
    {"attn_v": "Q8_0", "ffn_down": "F16"}), as llama-quantize mixes them (K-quants need `hidden` and
    `ffn` multiples of 256), and the embedding (the tied head) as `embedding`. `arch="qwen3"` writes
    Qwen3's q/k norms (attn_q_norm, attn_k_norm) and its head size as llama.cpp's converter does
    (`attention.key_length` / `value_length`, `head_dim` wide, default hidden / heads). `head` (a type)
    writes a head of its own (`output.weight`) instead of the tied one. `arch="gemma3"` writes Gemma 3's
    layers as llama.cpp's converter does (q/k norms, the attention's and the MLP's output norms, a
    sliding window of 8), which transformers reads as a `gemma3_text` model with a scaled embedding."""
    HIDDEN, FFN = hidden, ffn  # noqa: N806 - the module's sizes, overridden
    rng = np.random.default_rng(seed)
    path = directory / "tiny.gguf"
    writer = GGUFWriter(str(path), arch)
    head_dim = head_dim or HIDDEN // HEADS
    if arch != "llama":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        writer.add_sliding_window(8)
    write_tiny_vocabulary(writer, VOCAB, unk=arch == "gemma3")

    def blocks(name: str, shape: tuple[int, int], qtype: GGMLQuantizationType) -> None:
        if qtype in (GGMLQuantizationType.F16, GGMLQuantizationType.F32):
            writer.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.dtype(qtype.name.lower().replace("f", "float"))))
            return
        if qtype.name in SCALE_OFFSETS:
            data = blocks_of(qtype.name, *shape, seed=int(rng.integers(1 << 30)), scale=0.002)
        else:
            data = quantize((rng.standard_normal(shape) * 0.2).astype(np.float32), qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    def floats(name: str) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    blocks("token_embd.weight", (VOCAB, HIDDEN), GGMLQuantizationType[embedding])
    floats("output_norm.weight")
    if head is not None:
        blocks("output.weight", (VOCAB, HIDDEN), GGMLQuantizationType[head])
    for i in range(LAYERS):
        floats(f"blk.{i}.attn_norm.weight")
        floats(f"blk.{i}.ffn_norm.weight")
        if arch == "gemma3":
            floats(f"blk.{i}.post_attention_norm.weight")
            floats(f"blk.{i}.post_ffw_norm.weight")
        if arch in ("qwen3", "gemma3"):
            for norm in ("attn_q_norm", "attn_k_norm"):
                writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(head_dim)).astype(np.float32))
        for name, shape in [("attn_q", (HEADS * head_dim, HIDDEN)), ("attn_k", (KV_HEADS * head_dim, HIDDEN)),
                            ("attn_v", (KV_HEADS * head_dim, HIDDEN)), ("attn_output", (HIDDEN, HEADS * head_dim)),
                            ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)), ("ffn_down", (HIDDEN, FFN))]:
            blocks(f"blk.{i}.{name}.weight", shape, GGMLQuantizationType[(kinds or {}).get(name, kind)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
