"""A tiny llama GGUF written with the `gguf` package: 4-bit linear layers and a Q8_0 embedding (tied
head), as llama.cpp's converter lays them out (q/k rows in its order), for the `quantize = auto` tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 96, 64, 2, 4, 2, 128


def write_tiny_gguf(directory: Path, kind: str = "Q4_1", seed: int = 0, kinds: dict[str, str] | None = None) -> Path:
    """`directory`/tiny.gguf with every projection stored as `kind` (a type gguf quantizes), but those
    named in `kinds` (e.g. {"attn_v": "Q8_0", "ffn_down": "F16"}), as llama-quantize mixes them."""
    rng = np.random.default_rng(seed)
    path = directory / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>".encode() for i in range(VOCAB)])
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([1] * VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def blocks(name: str, shape: tuple[int, int], qtype: GGMLQuantizationType) -> None:
        weights = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, weights.astype(np.float16))
            return
        data = quantize(weights, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    def floats(name: str) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    blocks("token_embd.weight", (VOCAB, HIDDEN), GGMLQuantizationType.Q8_0)
    floats("output_norm.weight")
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        floats(f"blk.{i}.attn_norm.weight")
        floats(f"blk.{i}.ffn_norm.weight")
        for name, shape in [("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (KV_HEADS * head_dim, HIDDEN)),
                            ("attn_v", (KV_HEADS * head_dim, HIDDEN)), ("attn_output", (HIDDEN, HIDDEN)),
                            ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)), ("ffn_down", (HIDDEN, FFN))]:
            blocks(f"blk.{i}.{name}.weight", shape, GGMLQuantizationType[(kinds or {}).get(name, kind)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
