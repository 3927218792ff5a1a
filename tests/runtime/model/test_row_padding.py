"""Results do not depend on what shares a step: padded row counts and per-query decode attention."""

import pytest
import torch
import torch.nn.functional as F

from runtime.model.decoder import LeanDecoder
from runtime.wire.params import SamplingParams
from runtime.wire.protocol import Delta, GenerateRequest
from runtime.model.row_padding import RowPadding, attention_windows
from tests.runtime.engine_helpers import engine_for


@pytest.fixture(autouse=True)
def own_startup_cache(tmp_path, monkeypatch):
    """Each test probes for itself: no verdict another test kept in the start-up cache (the kernels,
    loaded once a process, stay loaded)."""
    from runtime.kernels.cpu_kernels import q4_unavailable

    q4_unavailable()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "startup-cache"))


def test_pad_goes_up_to_the_next_safe_count():
    padding = RowPadding([4, 8, 12, 13, 64, 192], 256)
    assert [padding.pad(n) for n in (1, 3, 4, 5, 8, 9, 11, 12, 13, 14, 100, 192, 193, 256)] == [
        4, 4, 4, 8, 8, 12, 12, 12, 13, 64, 192, 192, 256, 256]
    with pytest.raises(ValueError, match="larger than the 256 rows probed"):
        padding.pad(257)
    assert [RowPadding.none().pad(n) for n in (1, 2, 7, 5000)] == [1, 2, 7, 5000]


def test_the_probe_trusts_no_count_it_did_not_see_agree(monkeypatch):
    """Counts above the small ones are buckets, each probed; a count whose bits differ is skipped."""
    import runtime.model.row_padding as row_padding

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
    import runtime.model.row_padding as row_padding

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    calls = []
    real_linear = F.linear

    def linear(x, weight, bias=None):
        calls.append(1)
        return real_linear(x, weight, bias) + len(calls) * 1e-6  # a kernel that is not repeatable

    monkeypatch.setattr(row_padding.F, "linear", linear)
    with pytest.raises(row_padding.InvarianceUnavailable, match="from one call to the next"):
        RowPadding.probe(model, max_rows=64)


def test_auto_serves_without_padding_where_the_probe_fails_and_says_so_once(tiny_llama, tmp_path, monkeypatch, caplog):
    """The default (auto) serves a device that cannot be shown invariant, with one warning naming what
    it means for seeds; true (`--deterministic`) refuses to start there; false never probes."""
    import runtime.model.row_padding as row_padding

    def fails(*args, **kwargs):
        raise row_padding.InvarianceUnavailable("a (64, 64) torch.float32 matmul on cpu gives different bits")

    assert engine_for(tiny_llama, batch_invariant="auto").padding is not None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "another-cache"))  # no verdict kept: probed again
    monkeypatch.setattr(row_padding.RowPadding, "probe", fails)
    with caplog.at_level("WARNING", logger="ponder.runtime"):
        engine = engine_for(tiny_llama, batch_invariant="auto")
    assert engine.padding is None and not engine.runner.exact_prefill
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith("batch invariance is off: a (64, 64) torch.float32") \
        and "A seeded request may give other tokens" in warnings[0]
    with pytest.raises(row_padding.InvarianceUnavailable, match="gives different bits"):
        engine_for(tiny_llama, batch_invariant=True)
    assert engine_for(tiny_llama, batch_invariant=False).padding is None


def test_the_probe_multiplies_the_layers_the_lean_decoder_runs(tiny_llama, monkeypatch):
    """The tiny llama (hidden 64, MLP 128, 4 query and 2 KV heads of 16, vocabulary 78): q/k/v run as
    one 64 -> 128 matmul and gate/up as one 64 -> 256, so those are the shapes probed, never the
    64 -> 32 of k or v alone."""
    import runtime.model.row_padding as row_padding
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    probed = {}
    real_linear = F.linear

    def linear(x, weight, bias=None):
        probed.setdefault(tuple(weight.shape), set()).add(weight.data_ptr())
        return real_linear(x, weight, bias)

    monkeypatch.setattr(row_padding.F, "linear", linear)
    RowPadding.probe(model, max_rows=64, max_model_len=16, block_size=4)
    assert sorted(probed) == [(64, 64), (64, 128), (78, 64), (128, 64), (256, 64)]
    decoder = LeanDecoder.build(model)  # the one the probe built, which the runner's will be
    assert model._ponder_lean_decoder is decoder
    first = decoder.layers[0]
    assert probed[(128, 64)] == {first.qkv.fused.weight.data_ptr()}
    assert probed[(256, 64)] == {first.gate_up.fused.weight.data_ptr()}
    # The separate layers' weights are views of the fused ones: the runner multiplies what was probed.
    assert model.model.layers[0].self_attn.k_proj.weight.data_ptr() == first.qkv.fused.weight.data_ptr() + 64 * 64 * 4


def test_a_model_the_lean_decoder_does_not_run_is_probed_layer_by_layer(monkeypatch):
    import runtime.model.row_padding as row_padding

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4, bias=False))
    model.config = type("Config", (), {"num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 8,
                                       "max_position_embeddings": 32})()
    probed = set()
    real_linear = F.linear

    def linear(x, weight, bias=None):
        probed.add(tuple(weight.shape))
        return real_linear(x, weight, bias)

    monkeypatch.setattr(row_padding.F, "linear", linear)
    RowPadding.probe(model, max_rows=16)
    assert probed == {(8, 8), (4, 8)}


def test_attention_windows_are_every_window_a_context_can_reach():
    # 512 tokens in blocks of 4: 128 blocks, windows bucketed to two significant bits, 64 queries each.
    assert attention_windows(512, 4) == [(w, 64) for w in (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)]
    # 5 blocks read a window of 6: past max_model_len, but a context of 17-20 tokens reads it.
    assert attention_windows(20, 4) == [(4, 64), (8, 64), (12, 64), (16, 64), (24, 64)]
    # 32k tokens in blocks of 16: wide windows hold fewer queries (2^16 keys a group at most).
    assert attention_windows(32768, 16) == [
        (16, 64), (32, 64), (48, 64), (64, 64), (96, 64), (128, 64), (192, 64), (256, 64), (384, 64), (512, 64),
        (768, 64), (1024, 64), (1536, 42), (2048, 32), (3072, 21), (4096, 16), (6144, 10), (8192, 8),
        (12288, 5), (16384, 4), (24576, 2), (32768, 2)]


def test_the_windows_probed_are_the_groups_the_runner_makes(tiny_llama):
    """Every query of one 64-token sequence in blocks of 4, grouped as the runner groups decode
    attention: the windows and most queries a group of each are those `attention_windows` lists."""
    import runtime.model.model_runner as model_runner
    import runtime.model.row_padding as row_padding

    assert row_padding.GATHER_TOKENS == model_runner.GATHER_TOKENS
    assert row_padding.ATTENTION_BATCH == model_runner.ATTENTION_BATCH
    runner = engine_for(tiny_llama, max_model_len=64).runner
    positions = torch.arange(64).repeat(3)  # three sequences, so a window's group can fill to 64 queries
    entry_of = torch.arange(3).repeat_interleave(64)
    tables = torch.arange(48)
    groups = runner._decode_groups(torch.arange(192), positions, entry_of, tables, torch.tensor([0, 16, 32]))
    windows = dict(attention_windows(64, 4))
    assert sorted({group.width for group in groups}) == sorted(windows) == [4, 8, 12, 16, 24, 32, 48, 64]
    assert all(group.rows.shape[0] <= windows[group.width] for group in groups)


def probed_attention(monkeypatch, build):
    """(window, batch count) of every queries @ keys^T matmul (head dim 16) while `build()` runs."""
    scored = set()
    real_matmul = torch.matmul

    def matmul(a, b):
        if a.dim() == 4 and a.shape[-1] == 16 and b.shape[-2] == 16:
            scored.add((b.shape[-1], a.shape[0]))
        return real_matmul(a, b)

    monkeypatch.setattr(torch, "matmul", matmul)
    build()
    monkeypatch.setattr(torch, "matmul", real_matmul)
    return scored


def test_the_engine_probes_attention_at_every_window_its_cache_reaches(tiny_llama, monkeypatch):
    """Contexts of up to max_model_len 64 in blocks of 4: windows of 4 to 64 tokens, each at every batch
    count from 1 to 64 queries (the old probe's 16, 64 and 256-token windows missed most of them), where
    decode attention runs as batched matmuls (here: a CPU where ponder's attention kernel does not build)."""
    import runtime.model.row_padding as row_padding
    from runtime.kernels.cpu_kernels import KernelUnavailable

    def unavailable():
        raise KernelUnavailable("no compiler")

    monkeypatch.setattr(row_padding, "attention_kernel", unavailable)
    scored = probed_attention(monkeypatch, lambda: engine_for(tiny_llama, max_model_len=64))
    assert scored == {(width, batch) for width in (4, 8, 12, 16, 24, 32, 48, 64) for batch in range(1, 65)}


def test_where_the_cpu_kernel_attends_there_is_no_batched_attention_to_probe(tiny_llama, monkeypatch):
    engines = []
    scored = probed_attention(monkeypatch, lambda: engines.append(engine_for(tiny_llama, max_model_len=64)))
    if engines[0].runner.attention_kernel is None:
        pytest.skip("ponder's CPU attention kernel does not build here")
    assert scored == set()


@pytest.mark.parametrize("device, dtype, head_dim", [
    ("cpu", torch.float32, 16), ("cpu", torch.float32, 12), ("cpu", torch.bfloat16, 16), ("meta", torch.float32, 16)])
def test_the_probe_and_the_runner_agree_on_which_attention_runs(device, dtype, head_dim):
    from runtime.model.model_runner import _attention_kernel
    from runtime.model.row_padding import decode_attention_is_batched
    from storage.kv_cache import KVCache, KVShape

    cache = KVCache(KVShape(num_layers=1, num_kv_heads=1, head_dim=head_dim, block_size=4), 2, dtype,
                    torch.device(device))
    assert decode_attention_is_batched(cache.device, dtype, head_dim) == (_attention_kernel(cache) is None)


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
        from runtime.model.model_runner import ModelRunner
        from storage.kv_cache import KVCache
        ModelRunner(engine.model, KVCache(engine.cache.shape, 4, torch.float32, torch.device("cpu")),
                    RowPadding([4], 64))


def test_the_probe_s_verdict_is_kept_for_the_next_start(tiny_llama, tmp_path, monkeypatch, caplog):
    # With the model's identity given (as bootstrap gives it), a CPU keeps the verdict in the start-up
    # cache: a second start reads it instead of probing; a refusal is kept too.
    from transformers import AutoModelForCausalLM

    import runtime.model.row_padding as row_padding
    from runtime.startup_cache import file_identity

    row_padding.decode_attention_is_batched(torch.device("cpu"), torch.float32, 64)  # kernels from the usual cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    probe, probes = row_padding.RowPadding.probe, []
    monkeypatch.setattr(row_padding.RowPadding, "probe",
                        classmethod(lambda cls, *a, **k: probes.append(1) or probe(*a, **k)))
    identity = {"model": file_identity(tiny_llama), "key": "tiny"}
    first = row_padding.padding_for(model, "auto", 96, 8, max_model_len=64, cache=identity)
    second = row_padding.padding_for(model, "auto", 96, 8, max_model_len=64, cache=identity)
    assert len(probes) == 1 and second.safe_counts == first.safe_counts and second.max_rows == first.max_rows
    row_padding.padding_for(model, "auto", 128, 8, max_model_len=64, cache=identity)  # another setting: probed
    assert len(probes) == 2

    def fails(cls, *args, **kwargs):
        probes.append(1)
        raise row_padding.InvarianceUnavailable("this device is not deterministic")

    monkeypatch.setattr(row_padding.RowPadding, "probe", classmethod(fails))
    refused = {"model": file_identity(tiny_llama), "key": "another"}
    with caplog.at_level("WARNING"):
        assert row_padding.padding_for(model, "auto", 96, 8, max_model_len=64, cache=refused) is None
        assert row_padding.padding_for(model, "auto", 96, 8, max_model_len=64, cache=refused) is None
    with pytest.raises(row_padding.InvarianceUnavailable, match="not deterministic"):
        row_padding.padding_for(model, True, 96, 8, max_model_len=64, cache=refused)
    assert len(probes) == 3  # the refusal was probed once, then read
    assert sum("batch invariance is off" in r.message for r in caplog.records) == 2
