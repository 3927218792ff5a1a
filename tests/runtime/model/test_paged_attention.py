"""Paged decode attention, on both paths: ponder's CPU kernel (each query over exactly its own blocks)
and the torch one (windows bucketed by context length, masked exactly); both batch-independent."""

import types

import pytest
import torch

from runtime.model.attention import bucket_blocks, paged_attention
from runtime.kernels.cpu_kernels import attention_kernel, q4_unavailable
from runtime.model.model_runner import ModelRunner
from scheduler.scheduler import ScheduledSequence
from scheduler.sequence import Sequence
from storage.kv_cache import KVCache, KVShape

BS, KVH, H, D = 4, 2, 6, 8
PATHS = [pytest.param("kernel", marks=pytest.mark.skipif(q4_unavailable() is not None, reason="needs ponder's CPU kernels")),
         "torch"]


def _runner(cache, path):
    runner = ModelRunner(None, cache)
    assert runner.attention_kernel is not None or q4_unavailable() is not None  # a float32 cache on the CPU
    if path == "torch":
        runner.attention_kernel = None  # the path of every other device and dtype
    return runner


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


def _attend(cache, entries, path, seed=1):
    gen = torch.Generator().manual_seed(seed)
    t = len(entries)
    q, k, v = (torch.randn(1, n, t, D, generator=gen) for n in (H, KVH, KVH))
    step = _runner(cache, path)._prepare(entries, [])
    assert (step.meta.decode_rows is None) == (path == "torch")
    out, _ = paged_attention(types.SimpleNamespace(layer_idx=0), q, k, v, None, ponder_attention=step.meta)
    return q, out[0]


@pytest.mark.parametrize("path", PATHS)
def test_each_query_attends_exactly_its_own_context_and_garbage_past_it_cannot_leak(path):
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
    q, out = _attend(cache, entries, path)
    assert torch.isfinite(out).all()
    for row, (e, n) in enumerate(zip(entries, lengths)):
        keys, values = cache.gather(0, torch.tensor([e.seq.block_table]))
        keys, values = keys[0, :, :n].double(), values[0, :, :n].double()
        for h in range(H):
            w = torch.softmax(keys[h // (H // KVH)] @ q[0, h, row].double() * D ** -0.5, dim=0)
            torch.testing.assert_close(out[row, h], (w @ values[h // (H // KVH)]).float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_a_querys_bits_do_not_depend_on_the_other_queries(path):
    cache = _cache()
    alone_q, alone = _attend(cache, [_decoding(11, 0)], path, seed=3)
    crowd = [_decoding(3, 10), _decoding(11, 0), _decoding(12, 20), _decoding(16, 30)]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 1, D, generator=gen) for n in (H, KVH, KVH))
    gen = torch.Generator().manual_seed(9)
    others = [torch.randn(1, n, 4, D, generator=gen) for n in (H, KVH, KVH)]
    # The same query (and its key/value) in row 1 of a crowded step.
    qc, kc, vc = (torch.cat([o[:, :, :1], x, o[:, :, 1:3]], dim=2) for o, x in zip(others, (q, k, v)))
    step = _runner(cache, path)._prepare(crowd, [])
    out, _ = paged_attention(types.SimpleNamespace(layer_idx=0), qc, kc, vc, None, ponder_attention=step.meta)
    assert torch.equal(out[0, 1], alone[0])


def _reference(cache, layer, q, table, ctx, scale, softcap=0.0, window=0, sinks=None):
    """float64 attention of one query `[H, D]` over the first `ctx` positions of its blocks (the last
    `window` of them with a window), scores soft-capped with `softcap`, each head's sink `sinks` `[H]`
    in the softmax's denominator."""
    blocks = cache.kv[table][:, layer].double()  # [blocks, 2, KVH, BS, D]
    first = max(0, ctx - window) if window else 0
    keys = blocks[:, 0].permute(1, 0, 2, 3).reshape(KVH, -1, D)[:, first:ctx]
    values = blocks[:, 1].permute(1, 0, 2, 3).reshape(KVH, -1, D)[:, first:ctx]
    scores = q.double().view(KVH, H // KVH, D) @ keys.transpose(1, 2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if sinks is None:
        return (torch.softmax(scores, dim=-1) @ values).reshape(H, D)
    sink = sinks.double().view(KVH, H // KVH, 1)
    weights = torch.softmax(torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1), dim=-1)[..., :-1]
    return (weights @ values).reshape(H, D)


@pytest.mark.skipif(q4_unavailable() is not None, reason="needs ponder's CPU kernels")
@pytest.mark.parametrize("window", [0, 5])
def test_the_kernel_adds_each_heads_sink_to_the_softmax(window):
    """gpt-oss's attention sinks: one more logit per head in the denominator, weighing no value; and
    the torch path (decode groups) agrees with the kernel on the same step."""
    cache = KVCache(KVShape(2, KVH, D, BS), 16, torch.float32, torch.device("cpu"))
    cache.kv.normal_(generator=torch.Generator().manual_seed(8))
    gen = torch.Generator().manual_seed(10)
    tables = torch.stack([torch.randperm(16, generator=gen)[:8] for _ in range(3)])
    ctx = torch.tensor([1, 9, 30])
    queries = torch.randn(3, H, D, generator=gen)
    sinks = 1.0 + 2.0 * torch.randn(H, generator=gen)
    rows = torch.arange(3)
    out = torch.zeros(3, H, D)
    attention_kernel()(queries, rows, cache.kv, tables, ctx, 1, 0.3, out, 0.0, window, sinks)
    for g in range(3):
        torch.testing.assert_close(out[g].double(), _reference(cache, 1, queries[g], tables[g], int(ctx[g]), 0.3,
                                                               window=window, sinks=sinks), rtol=1e-5, atol=1e-6)
    plain = torch.zeros(3, H, D)
    attention_kernel()(queries, rows, cache.kv, tables, ctx, 1, 0.3, plain, 0.0, window)
    assert not torch.allclose(plain, out)  # the sinks change every result


@pytest.mark.skipif(q4_unavailable() is not None, reason="needs ponder's CPU kernels")
@pytest.mark.parametrize("softcap, window", [(0.5, 0), (0.0, 5), (0.5, 20)])
def test_the_kernel_caps_scores_and_keeps_to_a_sliding_window(softcap, window):
    """Gemma 2's attention: softcap * tanh(score / softcap), and only the last `window` positions."""
    cache = KVCache(KVShape(2, KVH, D, BS), 16, torch.float32, torch.device("cpu"))
    cache.kv.normal_(generator=torch.Generator().manual_seed(8))
    gen = torch.Generator().manual_seed(9)
    tables = torch.stack([torch.randperm(16, generator=gen)[:8] for _ in range(3)])
    ctx = torch.tensor([3, 17, 31])  # inside the window, across it, far past it
    queries = torch.randn(3, H, D, generator=gen) * 4  # large scores, so capping changes them
    rows = torch.arange(3)
    out = torch.zeros(3, H, D)
    attention_kernel()(queries, rows, cache.kv, tables, ctx, 1, 0.3, out, softcap, window)
    for g in range(3):
        torch.testing.assert_close(out[g].double(), _reference(cache, 1, queries[g], tables[g], int(ctx[g]), 0.3,
                                                               softcap, window), rtol=1e-5, atol=1e-6)
    plain = torch.zeros(3, H, D)
    attention_kernel()(queries, rows, cache.kv, tables, ctx, 1, 0.3, plain)
    assert not torch.allclose(plain[2], out[2])  # the features change the result


@pytest.mark.skipif(q4_unavailable() is not None, reason="needs ponder's CPU kernels")
def test_the_kernel_reads_any_layer_any_block_order_and_only_the_rows_asked_for():
    cache = KVCache(KVShape(3, KVH, D, BS), 40, torch.float32, torch.device("cpu"))
    cache.kv.normal_(generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(6)
    tables = torch.stack([torch.randperm(40, generator=gen)[:12] for _ in range(4)])  # shuffled, shared
    tables[2, :3] = tables[0, :3]
    ctx = torch.tensor([1, 17, 45, 48])  # one position, partial blocks, every position of 12 blocks
    queries = torch.randn(7, H + KVH, D, generator=gen)[:, :H]  # a strided view, as the lean forward's
    rows = torch.tensor([5, 0, 3, 6])
    out = torch.full((7, H, D), 7.0)
    attention_kernel()(queries, rows, cache.kv, tables, ctx, 2, 0.3, out)
    for g, row in enumerate(rows.tolist()):
        torch.testing.assert_close(out[row].double(), _reference(cache, 2, queries[row], tables[g], int(ctx[g]), 0.3),
                                   rtol=1e-5, atol=1e-6)
    assert (out[[1, 2, 4]] == 7.0).all()  # rows not asked for are left alone
    alone = torch.zeros(7, H, D)
    attention_kernel()(queries, rows[2:3], cache.kv, tables[2:3], ctx[2:3], 2, 0.3, alone)
    assert torch.equal(alone[3], out[3])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        again = torch.full((7, H, D), 7.0)
        attention_kernel()(queries, rows, cache.kv, tables, ctx, 2, 0.3, again)
        assert torch.equal(again, out)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(q4_unavailable() is not None, reason="needs ponder's CPU kernels")
@pytest.mark.parametrize("heads", [H, KVH, 4 * KVH, 5 * KVH])  # every grouped-query tile, and the general one
@pytest.mark.parametrize("softcap, window", [(0.0, 0), (0.5, 5)])
def test_a_bfloat16_cache_gives_the_bits_of_a_float32_cache_of_its_values(heads, softcap, window):
    """A bfloat16 model's cache is read as it is, widened element by element: the same bits as the
    float32 kernel on the same values, on every path through the kernel (four keys at a time and the
    rest, each grouped-query tile and the general loop), and near the float64 reference."""
    narrow = KVCache(KVShape(2, KVH, 16, BS), 24, torch.bfloat16, torch.device("cpu"))
    narrow.kv.copy_(torch.randn(narrow.kv.shape, generator=torch.Generator().manual_seed(11)))
    wide = KVCache(KVShape(2, KVH, 16, BS), 24, torch.float32, torch.device("cpu"))
    wide.kv.copy_(narrow.kv.float())
    gen = torch.Generator().manual_seed(12)
    tables = torch.stack([torch.randperm(24, generator=gen)[:12] for _ in range(4)])
    ctx = torch.tensor([1, 6, 23, 45])
    queries = torch.randn(4, heads, 16, generator=gen)
    rows = torch.arange(4)
    out, expected = torch.zeros(4, heads, 16), torch.zeros(4, heads, 16)
    attention_kernel()(queries, rows, narrow.kv, tables, ctx, 1, 0.3, out, softcap, window)
    attention_kernel()(queries, rows, wide.kv, tables, ctx, 1, 0.3, expected, softcap, window)
    assert torch.equal(out, expected)
    for g in range(4):
        keys = wide.gather(1, tables[g:g + 1])[0][0, :, :int(ctx[g])].double()
        values = wide.gather(1, tables[g:g + 1])[1][0, :, :int(ctx[g])].double()
        q = queries[g].double().view(KVH, heads // KVH, 16)
        scores = q @ keys.transpose(-1, -2) * 0.3
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if window:
            scores[..., :max(0, int(ctx[g]) - window)] = float("-inf")
        reference = (torch.softmax(scores, dim=-1) @ values).reshape(heads, 16)
        torch.testing.assert_close(out[g].double(), reference, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(q4_unavailable() is not None, reason="needs ponder's CPU kernels")
def test_a_batch_split_across_threads_gives_each_query_its_bits_alone():
    """Several queries with 512 (key, KV head) pairs or more go to every thread (one query alone keeps
    to the calling thread below 4,096): each query's bits are those it gets alone on one thread."""
    cache = KVCache(KVShape(1, KVH, D, BS), 64, torch.float32, torch.device("cpu"))
    cache.kv.normal_(generator=torch.Generator().manual_seed(13))
    gen = torch.Generator().manual_seed(14)
    tables = torch.stack([torch.randperm(64, generator=gen)[:20] for _ in range(8)])
    ctx = torch.tensor([40, 77, 9, 64, 80, 33, 71, 58])  # 432 keys, 864 pairs over 2 KV heads
    queries = torch.randn(8, H, D, generator=gen)
    rows = torch.arange(8)
    batch = torch.zeros(8, H, D)
    attention_kernel()(queries, rows, cache.kv, tables, ctx, 0, 0.3, batch)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for g in range(8):
            alone = torch.zeros(8, H, D)
            attention_kernel()(queries, rows[g:g + 1], cache.kv, tables[g:g + 1], ctx[g:g + 1], 0, 0.3, alone)
            assert torch.equal(alone[g], batch[g])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(q4_unavailable() is not None, reason="needs ponder's CPU kernels")
def test_the_kernel_refuses_what_it_cannot_read():
    cache = KVCache(KVShape(2, KVH, D, BS), 8, torch.float32, torch.device("cpu"))
    q, out = torch.randn(2, H, D), torch.zeros(2, H, D)
    rows, tables = torch.tensor([0, 1]), torch.tensor([[0, 1], [2, 3]])
    kernel = attention_kernel()
    with pytest.raises(RuntimeError, match="does not fit its table"):
        kernel(q, rows, cache.kv, tables, torch.tensor([3, 9]), 0, 1.0, out)
    with pytest.raises(RuntimeError, match="no block 8"):
        kernel(q, rows, cache.kv, torch.tensor([[0, 1], [8, 3]]), torch.tensor([3, 5]), 0, 1.0, out)
    with pytest.raises(RuntimeError, match="no layer 2"):
        kernel(q, rows, cache.kv, tables, torch.tensor([3, 5]), 2, 1.0, out)
    with pytest.raises(RuntimeError, match="row 2 is not a query"):
        kernel(q, torch.tensor([0, 2]), cache.kv, tables, torch.tensor([3, 5]), 0, 1.0, out)
    with pytest.raises(RuntimeError, match="cache must be contiguous float32 or bfloat16"):
        kernel(q, rows, cache.kv.half(), tables, torch.tensor([3, 5]), 0, 1.0, out)


def test_both_paths_cap_scores_and_keep_to_a_sliding_window_alike():
    """Gemma 2's soft-capping and sliding window reach the torch path too (every other device and
    dtype): its results equal the kernel's, and differ from attention without them."""
    if q4_unavailable() is not None:
        pytest.skip("needs ponder's CPU kernels")
    cache = _cache()
    entries = [_decoding(3, 0), _decoding(10, 2), _decoding(23, 6)]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 3, D, generator=gen) * 3 for n in (H, KVH, KVH))
    results = {}
    for path in ("kernel", "torch"):
        for features in ({}, {"softcap": 0.7, "sliding_window": 6}):
            step = _runner(cache, path)._prepare(entries, [])
            out, _ = paged_attention(types.SimpleNamespace(layer_idx=0), q, k, v, None, ponder_attention=step.meta,
                                     **features)
            results[path, bool(features)] = out[0]
    torch.testing.assert_close(results["torch", True], results["kernel", True], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(results["torch", True], results["torch", False])


@pytest.mark.skipif(q4_unavailable() is not None, reason="needs ponder's CPU kernels")
@pytest.mark.parametrize("exact_prefill", [True, False])
def test_a_plain_decode_step_s_inputs_are_the_general_path_s(monkeypatch, exact_prefill):
    """runtime.model.decode_step's lists give the step `_prepare` builds with its tensor operations: the
    same tokens, positions, slots, contexts and, within each context, block tables."""
    import runtime.model.model_runner as model_runner

    cache = _cache()
    entries = [_decoding(9, 0), _decoding(1 + BS, 5), _decoding(2, 8), _decoding(3 * BS, 10)]
    entries[2].seq.block_table.append(39)  # a block past its context (allocated ahead)
    runner = _runner(cache, "kernel")
    runner.exact_prefill = exact_prefill
    plain = runner._prepare(entries, [])
    monkeypatch.setattr(model_runner, "plain_decode", lambda *args: None)
    general = runner._prepare(entries, [])
    for name in ("input_ids", "positions", "last_token_index", "entry_start"):
        got, want = getattr(plain, name), getattr(general, name)
        assert (torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want), name
    assert torch.equal(plain.meta.slot_rows, general.meta.slot_rows)
    p, g = plain.meta.decode_rows, general.meta.decode_rows
    assert torch.equal(p.rows, g.rows) and torch.equal(p.ctx, g.ctx) and p.tables.shape == g.tables.shape
    for row, ctx in enumerate(g.ctx.tolist()):
        blocks = -(-ctx // BS)
        assert torch.equal(p.tables[row, :blocks], g.tables[row, :blocks])
    assert not plain.meta.decode_groups and not plain.meta.prefills and plain.meta.num_padding == 0
    q, k, v = (torch.randn(1, n, len(entries), D, generator=torch.Generator().manual_seed(3)) for n in (H, KVH, KVH))
    layer = types.SimpleNamespace(layer_idx=0)
    assert torch.equal(paged_attention(layer, q, k, v, None, ponder_attention=plain.meta)[0],
                       paged_attention(layer, q, k, v, None, ponder_attention=general.meta)[0])


def test_a_step_with_a_prompt_token_is_not_a_plain_decode():
    from runtime.model.decode_step import plain_decode

    seq = Sequence(list(range(6)), num_prompt_tokens=6)
    seq.num_computed_tokens, seq.block_table = 5, [0, 1]
    prompt_end = ScheduledSequence(seq, 1)  # the prompt's last token
    assert plain_decode([prompt_end], BS, exact_prefill=False) is None
    assert plain_decode([prompt_end], BS, exact_prefill=True) is not None  # every token attends alone
    assert plain_decode([_decoding(9, 0), ScheduledSequence(_decoding(5, 3).seq, 2)], BS, exact_prefill=True) is None
    assert plain_decode([], BS, exact_prefill=True) is None
