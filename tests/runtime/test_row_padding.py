"""Results do not depend on what shares a step: padded row counts and per-query decode attention."""

import pytest
import torch
import torch.nn.functional as F

from runtime.protocol import Delta, GenerateRequest, SamplingParams
from runtime.row_padding import RowPadding
from tests.runtime.engine_helpers import engine_for


def test_pad_goes_up_to_the_next_safe_count():
    padding = RowPadding([4, 8, 12, 13, 64, 192], 256)
    assert [padding.pad(n) for n in (1, 3, 4, 5, 8, 9, 11, 12, 13, 14, 100, 192, 193, 256)] == [
        4, 4, 4, 8, 8, 12, 12, 12, 13, 64, 192, 192, 256, 256]
    with pytest.raises(ValueError, match="larger than the 256 rows probed"):
        padding.pad(257)
    assert [RowPadding.none().pad(n) for n in (1, 2, 7, 5000)] == [1, 2, 7, 5000]


def test_the_probe_trusts_no_count_it_did_not_see_agree(monkeypatch):
    """Counts above the small ones are buckets, each probed; a count whose bits differ is skipped."""
    import runtime.row_padding as row_padding

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    model.config = type("Config", (), {"num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 8})()

    def linear(x, weight, bias=None):
        out = (x.unsqueeze(1) * weight).sum(-1) + bias  # row by row: no count differs by itself
        return out + 1e-3 if x.shape[0] in (3, 128) else out  # a kernel that differs at 3 and 128 rows

    monkeypatch.setattr(row_padding.F, "linear", linear)
    padding = RowPadding.probe(model, max_rows=300)
    assert padding.safe_counts == [r for r in range(1, 49) if r != 3] + [64, 192, 256, 300]
    assert padding.pad(3) == 4 and padding.pad(65) == 192 and padding.pad(257) == 300


def test_a_device_that_is_not_deterministic_run_to_run_is_refused(monkeypatch):
    import runtime.row_padding as row_padding

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    calls = []
    real_linear = F.linear

    def linear(x, weight, bias=None):
        calls.append(1)
        return real_linear(x, weight, bias) + len(calls) * 1e-6  # a kernel that is not repeatable

    monkeypatch.setattr(row_padding.F, "linear", linear)
    with pytest.raises(row_padding.InvarianceUnavailable, match="from one call to the next"):
        RowPadding.probe(model, max_rows=64)


def test_probed_counts_give_every_row_the_bits_of_a_large_call(tiny_llama):
    engine = engine_for(tiny_llama)
    padding = engine.runner.padding
    layers = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    x = torch.randn(64, engine.model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    for layer in layers:
        if layer.in_features != x.shape[1]:
            continue
        reference = F.linear(x, layer.weight, layer.bias)
        for rows in range(1, 40):
            padded = padding.pad(rows)
            assert padded >= rows
            assert torch.equal(F.linear(x[:padded], layer.weight, layer.bias)[:rows], reference[:rows])


def sampled(engine, request_id, prompt_ids, n=1):
    engine.add_request(GenerateRequest(request_id=request_id, endpoint="completion", prompt_token_ids=prompt_ids,
                                       sampling=SamplingParams(max_tokens=12, temperature=0.9, seed=4, n=n,
                                                               logprobs=True, ignore_eos=True)))


def logprobs_of(engine, request_id):
    got = {}
    while engine.has_work:
        for m in engine.step():
            if isinstance(m, Delta) and m.request_id == request_id and m.index == 0:
                got.setdefault("tokens", []).extend(m.token_ids)
                got.setdefault("logprobs", []).extend(t.logprob for t in m.logprobs)
    return got


def test_a_sequence_decodes_to_the_same_bits_alone_or_beside_others(tiny_llama):
    # Two engines, so the second prompt is computed afresh, not found in the prefix cache.
    engine = engine_for(tiny_llama, num_blocks=256)
    sampled(engine, "alone", (1, 5, 9, 13, 17))
    alone = logprobs_of(engine, "alone")
    engine = engine_for(tiny_llama, num_blocks=256)
    sampled(engine, "crowd-a", (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12), n=3)
    sampled(engine, "beside", (1, 5, 9, 13, 17))
    sampled(engine, "crowd-b", (7, 7, 8), n=2)
    beside = logprobs_of(engine, "beside")
    assert alone == beside and len(alone["tokens"]) == 12


def test_without_batch_invariance_nothing_is_padded(tiny_llama):
    engine = engine_for(tiny_llama, batch_invariant=False)
    assert engine.runner.padding.pad(1) == 1
    with pytest.raises(ValueError, match="scratch"):
        from runtime.model_runner import ModelRunner
        from storage.kv_cache import KVCache
        ModelRunner(engine.model, KVCache(engine.cache.shape, 4, torch.float32, torch.device("cpu")),
                    RowPadding([4], 64))
