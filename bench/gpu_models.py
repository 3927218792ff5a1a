"""The models the device check (bench/gpu.py) decodes: random llamas of published shapes, made on the
device (nothing downloaded), and the helpers its steps share."""

from __future__ import annotations

import gc

import torch

EIGHT_B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, tie_word_embeddings=True)  # the embedded model's shapes
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)  # --dry-run's stand-in for both
LBS_SHAPES = dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                  rope_theta=500000.0)  # Llama-3.2-1B's shapes (the vocabulary the tokenizer's)


def random_llama(device: torch.device, shapes: dict = EIGHT_B, dtype: torch.dtype = torch.bfloat16):
    """A llama of `shapes` (default Llama-3-8B's) with random weights made on the device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shapes)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def empty_cache() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
