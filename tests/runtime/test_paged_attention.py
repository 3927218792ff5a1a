"""Paged decode attention: windows bucketed by context length, masked exactly, batch-independent."""

import types

import torch

from runtime.attention import bucket_blocks, paged_attention
from runtime.model_runner import ModelRunner
from scheduler.scheduler import ScheduledSequence
from scheduler.sequence import Sequence
from storage.kv_cache import KVCache, KVShape

BS, KVH, H, D = 4, 2, 6, 8


def test_windows_round_the_block_count_up_to_two_significant_bits():
    assert [bucket_blocks(n) for n in range(1, 18)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16, 24]
    assert all(n <= bucket_blocks(n) < 1.5 * n for n in range(1, 3000))


def _cache():
    cache = KVCache(KVShape(1, KVH, D, BS), 40, torch.float32, torch.device("cpu"), scratch=True)
    cache.kv.normal_(generator=torch.Generator().manual_seed(0))
    return cache


def _decoding(ctx_len: int, first_block: int) -> ScheduledSequence:
    """A sequence whose token `ctx_len - 1` (a generated one) is computed in this step."""
    seq = Sequence(list(range(ctx_len)), num_prompt_tokens=1)
    seq.num_computed_tokens = ctx_len - 1
    seq.block_table = list(range(first_block, first_block + -(-ctx_len // BS)))
    return ScheduledSequence(seq, 1)


def _attend(cache, entries, seed=1):
    gen = torch.Generator().manual_seed(seed)
    t = len(entries)
    q, k, v = (torch.randn(1, n, t, D, generator=gen) for n in (H, KVH, KVH))
    step = ModelRunner(None, cache)._prepare(entries, [])
    out, _ = paged_attention(types.SimpleNamespace(layer_idx=0), q, k, v, None, ponder_attention=step.meta)
    return q, out[0]


def test_each_query_attends_exactly_its_own_context_and_garbage_past_it_cannot_leak():
    cache = _cache()
    lengths = [5, 9, 13, 14, 30]
    entries, block = [], 0
    for n in lengths:
        entries.append(_decoding(n, block))
        block += -(-n // BS)
    # Slots past every context (the rest of its last block, the scratch block) hold inf and NaN.
    for e, n in zip(entries, lengths):
        cache.kv[e.seq.block_table[-1], 0, :, :, n % BS or BS:] = float("nan")
    cache.kv[cache.scratch_block] = float("inf")
    q, out = _attend(cache, entries)
    assert torch.isfinite(out).all()
    for row, (e, n) in enumerate(zip(entries, lengths)):
        keys, values = cache.gather(0, torch.tensor([e.seq.block_table]))
        keys, values = keys[0, :, :n].double(), values[0, :, :n].double()
        for h in range(H):
            w = torch.softmax(keys[h // (H // KVH)] @ q[0, h, row].double() * D ** -0.5, dim=0)
            torch.testing.assert_close(out[row, h], (w @ values[h // (H // KVH)]).float(), rtol=1e-5, atol=1e-6)


def test_a_querys_bits_do_not_depend_on_the_other_queries():
    cache = _cache()
    alone_q, alone = _attend(cache, [_decoding(11, 0)], seed=3)
    crowd = [_decoding(3, 10), _decoding(11, 0), _decoding(12, 20), _decoding(16, 30)]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 1, D, generator=gen) for n in (H, KVH, KVH))
    gen = torch.Generator().manual_seed(9)
    others = [torch.randn(1, n, 4, D, generator=gen) for n in (H, KVH, KVH)]
    # The same query (and its key/value) in row 1 of a crowded step.
    qc, kc, vc = (torch.cat([o[:, :, :1], x, o[:, :, 1:3]], dim=2) for o, x in zip(others, (q, k, v)))
    step = ModelRunner(None, cache)._prepare(crowd, [])
    out, _ = paged_attention(types.SimpleNamespace(layer_idx=0), qc, kc, vc, None, ponder_attention=step.meta)
    assert torch.equal(out[0, 1], alone[0])
