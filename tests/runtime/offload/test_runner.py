"""The offload attention computes what transformers computes: logits match a plain forward."""

import torch

from runtime.offload import attention
from runtime.offload.runner import DecodeEntry, OffloadRunner
from storage.kv_cache import KVCache, KVShape

IDS = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 6, 10, 14, 18, 22, 7, 11, 15]


def reference_logits(model, ids):
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    finally:
        model.set_attn_implementation(previous)


def test_prefill_and_decode_logits_match_a_plain_forward(model):
    config = model.config
    shape = KVShape(config.num_hidden_layers, config.num_key_value_heads,
                    config.hidden_size // config.num_attention_heads, block_size=4)
    cache = KVCache(shape, 16, torch.float32, torch.device("cpu"))
    runner = OffloadRunner(model)
    previous = model.config._attn_implementation
    model.set_attn_implementation(attention.register())
    try:
        # Two sequences sharing a 12-token prefix in blocks 0-2, then apart: a in 3-5, b in 8-10.
        a, b = IDS[:18], IDS[:12] + IDS[15:21]
        table_a, table_b = (0, 1, 2, 3, 4, 5), (0, 1, 2, 8, 9, 10)
        got = runner.prefill(cache, a[:17], table_a)
        assert torch.allclose(got, reference_logits(model, a[:17]), atol=1e-4)
        runner.prefill(cache, b[:12], table_b)  # rewrites the shared prefix with the same values
        # b catches up alone, then both decode in one pass at different lengths.
        for position in range(12, 16):
            [got] = runner.decode(cache, [DecodeEntry(b[position], position, table_b[:position // 4 + 1])])
            assert torch.allclose(got, reference_logits(model, b[:position + 1]), atol=1e-4)
        both = runner.decode(cache, [DecodeEntry(a[17], 17, table_a[:5]),
                                     DecodeEntry(b[16], 16, table_b[:5])])
        assert torch.allclose(both[0], reference_logits(model, a[:18]), atol=1e-4)
        assert torch.allclose(both[1], reference_logits(model, b[:17]), atol=1e-4)
    finally:
        model.set_attn_implementation(previous)
