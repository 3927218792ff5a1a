"""A GGUF loaded tensor by tensor into int layers (runtime.model.gguf_load): the same model as
transformers' float load followed by `apply_quantize`, bit for bit, and in the memory its file takes."""

import json

import numpy as np

import pytest
import torch
from torch import nn

from bench.gguf_memory import measure_loads, write_7b_shaped
from runtime.kernels.cpu_kernels import q4_unavailable
from runtime.model.cached_model import _tensors, gguf_config
from runtime.model.gguf_load import load_gguf_blocks
from runtime.model.loader import CheckpointMismatch, load_causal_lm, resolve_model
from runtime.model.block_embedding import BlockEmbedding, HeadRowsEmbedding
from runtime.model.float_layers import FloatLinear
from runtime.model.quantize import Int4Linear, apply_quantize
from tests.gguf_model import write_tiny_gguf
from tests.runtime.engine_helpers import engine_for, hf_greedy, request, run

pytestmark = pytest.mark.skipif(q4_unavailable() is not None, reason="int layers need ponder's CPU kernel")

MIXED = {"attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_down": "Q8_0"}
# As llama-quantize's Q4_K_M mixes them (plus the other K and IQ4 types), on 256-wide rows.
K_MIXED = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "attn_output": "Q5_K", "ffn_up": "IQ4_XS", "attn_k": "IQ4_NL",
           "ffn_gate": "Q3_K", "attn_q": "Q2_K"}


def both_ways(path):
    source = resolve_model(str(path))
    reference = load_causal_lm(source, torch.device("cpu"), torch.float32, "sdpa")
    expected = apply_quantize(reference, "auto", source.path)
    model, quantized = load_gguf_blocks(source, gguf_config(source), torch.float32, "sdpa")
    return reference, expected, model, quantized


@pytest.mark.parametrize("kind,kinds,hidden", [("Q4_1", None, 64), ("Q8_0", None, 64), ("Q5_1", MIXED, 64),
                                                ("Q4_K", K_MIXED, 256)])
def test_the_streamed_model_is_transformers_model_with_its_blocks_kept_bit_for_bit(tmp_path, kind, kinds, hidden):
    reference, expected, model, quantized = both_ways(write_tiny_gguf(tmp_path, kind, kinds=kinds, hidden=hidden,
                                                                      ffn=2 * hidden))
    assert quantized == expected and quantized.mode == "int4" and quantized.layers == 15
    a, b = _tensors(reference), _tensors(model)
    # The embedding reads its rows from the tied head's blocks: it holds no tensor of its own, and every
    # row it gives is transformers' float row.
    assert a.keys() - b.keys() == {"model.embed_tokens.weight"} and b.keys() <= a.keys()
    for name in b:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert isinstance(model.model.embed_tokens, HeadRowsEmbedding) and model.model.embed_tokens.head is model.lm_head
    every_row = torch.arange(model.config.vocab_size)
    assert_same_bits(model.model.embed_tokens(every_row), reference.model.embed_tokens.weight)
    assert [type(m).__name__ for m in model.modules() if m is not model.model.embed_tokens] == \
        [type(m).__name__ for m in reference.modules() if m is not reference.model.embed_tokens]
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


def assert_serves_generate_s_tokens(engine, path) -> None:
    """The engine's greedy tokens equal `generate` on transformers' load of the file with the same int layers."""
    reference = load_causal_lm(resolve_model(str(path)), torch.device("cpu"), torch.float32, "sdpa")
    apply_quantize(reference, "auto", str(path))
    prompts = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 20, 21], [1, 40]]
    results = run(engine, [request(str(i), p, max_tokens=10) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert results[str(i)]["choices"][0] == hf_greedy(reference, prompt, 10)


def test_a_k_quant_file_serves_the_tokens_generate_gives_on_the_same_int_layers(tmp_path):
    path = write_tiny_gguf(tmp_path, "Q4_K", kinds=K_MIXED, hidden=256, ffn=512)
    engine = engine_for(path, batch_invariant=False)  # quantize left at its default, auto
    assert engine.quantized.describe() == (
        "model.quantize = auto: int4 (15 layers keep the GGUF's blocks (2 IQ4_NL, 2 IQ4_XS, 2 Q2_K, 2 Q3_K, 2 Q5_K, "
        "4 Q6_K, 1 Q8_0); linear tensors in the file: 2 IQ4_NL, 2 IQ4_XS, 2 Q2_K, 2 Q3_K, 2 Q5_K, 4 Q6_K, 1 Q8_0)")
    assert_serves_generate_s_tokens(engine, path)


def test_a_mixed_file_runs_the_whole_stack_kernel_and_serves_the_tokens_generate_gives(tmp_path):
    # q Q5_0, k Q5_1 and v Q8_0 fuse (widened to 8-bit codes), so every layer is the int kernel's.
    path = write_tiny_gguf(tmp_path, "Q5_1", kinds=MIXED)
    engine = engine_for(path, batch_invariant=False)
    assert engine.runner.decoder.int4
    assert engine.quantized.block_types == ("Q4_0", "Q5_0", "Q5_1", "Q8_0")  # what /v1/models shows
    assert_serves_generate_s_tokens(engine, path)


def test_the_mixed_file_s_start_up_line_names_every_type_kept(tmp_path):
    _, _, _, quantized = both_ways(write_tiny_gguf(tmp_path, "Q5_1", kinds=MIXED))
    assert quantized.describe() == (
        "model.quantize = auto: int4 (15 layers keep the GGUF's blocks (2 Q4_0, 2 Q5_0, 6 Q5_1, 5 Q8_0); "
        "linear tensors in the file: 2 Q4_0, 2 Q5_0, 6 Q5_1, 5 Q8_0)")  # the tied head is the Q8_0 embedding


def test_a_layer_of_a_type_no_kernel_runs_alone_keeps_float_weights(tmp_path):
    path = write_tiny_gguf(tmp_path, "Q4_1", kinds={"ffn_up": "IQ2_XXS"}, hidden=256, ffn=512)
    reference, expected, model, quantized = both_ways(path)
    assert quantized.describe() == (
        "model.quantize = auto: int4 (13 layers keep the GGUF's blocks (12 Q4_1, 1 Q8_0), 2 keep float weights "
        "(no kernel of ponder's for IQ2_XXS); linear tensors in the file: 2 IQ2_XXS, 12 Q4_1, 1 Q8_0)")
    floats = sorted(name for name, m in model.named_modules() if isinstance(m, nn.Linear))
    assert floats == ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"]
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 13
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


FLOATS = {"ffn_up": "F16", "attn_output": "BF16", "ffn_down": "F32"}


def test_float_tensors_run_in_the_float_kernel_in_the_file_s_own_type(tmp_path):
    path = write_tiny_gguf(tmp_path, "Q4_1", kinds=FLOATS)
    reference, _, model, quantized = both_ways(path)
    assert quantized.describe() == (
        "model.quantize = auto: int4 (9 layers keep the GGUF's blocks (8 Q4_1, 1 Q8_0), 6 run in ponder's float "
        "kernel in the file's own type (2 BF16, 2 F16, 2 F32); linear tensors in the file: 2 BF16, 2 F16, 2 F32, "
        "8 Q4_1, 1 Q8_0)")
    assert quantized.block_types == ("BF16", "F16", "F32", "Q4_1", "Q8_0")
    layers = dict(model.named_modules())
    for name, dtype in [("mlp.up_proj", torch.float16), ("self_attn.o_proj", torch.bfloat16),
                        ("mlp.down_proj", torch.float32)]:
        for i in range(2):
            layer = layers[f"model.layers.{i}.{name}"]
            assert isinstance(layer, FloatLinear) and layer.weight.dtype == dtype
            # the file's values (transformers widens them to float32)
            assert torch.equal(layer.weight.float(), reference.get_submodule(f"model.layers.{i}.{name}").weight)
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        assert (model(ids).logits - reference(ids).logits).abs().max().item() < 1e-4


def test_a_file_with_float_tensors_serves_the_tokens_generate_gives(tmp_path):
    path = write_tiny_gguf(tmp_path, "Q4_1", kinds=FLOATS)
    engine = engine_for(path, batch_invariant=False)
    assert_serves_generate_s_tokens(engine, path)


def test_an_f16_file_is_served_in_float16_with_no_padded_step(tmp_path):
    from gguf import GGUFReader

    path = write_tiny_gguf(tmp_path, "F16", embedding="F16")
    engine = engine_for(path)  # batch-invariant
    assert engine.quantized.describe() == (
        "model.quantize = auto: float (15 layers run in ponder's float kernel in the file's own type (15 F16); "
        "linear tensors in the file: 15 F16)")  # the tied head is the F16 embedding's values
    layers = [m for m in engine.model.modules() if isinstance(m, FloatLinear)]
    assert not any(type(m) is nn.Linear for m in engine.model.modules())
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors if t.tensor_type.name == "F16")
    assert sum(layer.weight.nbytes for layer in {id(l.weight): l for l in layers}.values()) == file_bytes
    assert engine.padding is None or [engine.padding.pad(n) for n in (1, 5, 57)] == [1, 5, 57]
    assert_serves_generate_s_tokens(engine, path)


def test_a_file_that_does_not_load_tensor_by_tensor_loads_through_transformers(tmp_path, monkeypatch, caplog):
    from runtime import startup_cache
    from runtime.model import cached_model

    def mismatch(source, *args):
        raise CheckpointMismatch(f"{source.path}: 1 model parameter(s) missing from the checkpoint (x)")

    monkeypatch.setattr(startup_cache, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr("runtime.model.gguf_load.load_gguf_blocks", mismatch)
    path = write_tiny_gguf(tmp_path, "Q4_1")
    model, quantized = cached_model.load_quantized_model(resolve_model(str(path)), torch.device("cpu"),
                                                         torch.float32, "sdpa", "auto")
    assert "does not load tensor by tensor" in caplog.text and "loading it through transformers" in caplog.text
    reference, expected, streamed, _ = both_ways(path)
    assert quantized == expected
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, streamed(ids).logits)


# 7B-class shapes (llama 2 7B's hidden and intermediate sizes and heads), four layers, a small vocabulary.
LAYERS = 4
CODE_ALLOWANCE = 256 * 2 ** 20  # what the modeling code allocates on the way: not the model's


def test_a_7b_shaped_gguf_loads_within_1_3x_its_file_size(tmp_path):
    path = tmp_path / "seven-b-shaped.gguf"
    write_7b_shaped(path, LAYERS)
    size = path.stat().st_size
    runs = measure_loads(path, tmp_path / "cache")  # from the file (writing the start-up cache), then from the cache
    print(json.dumps({"file": size, "runs": runs}))
    for run in runs:
        assert "int4 (29 layers keep the GGUF's blocks (24 Q4_1, 5 Q8_0)" in run["detail"]
        # Peak resident memory the load added (Linux's VmHWM, reset before loading), against the file
        # (no KV pool is made here), beside a fixed allowance that does not grow with the model.
        assert run["peak"] - run["before"] < 1.3 * size + CODE_ALLOWANCE, (run, size)
        assert run["held"] < size  # the served tensors: the file's blocks (the embedding's too) and float norms


@pytest.mark.parametrize("head_dim", [16, 32])  # hidden / heads, and a head size of its own (not Qwen3's 128)
def test_a_qwen3_file_takes_its_head_size_from_the_file_and_runs_the_int_stack(tmp_path, head_dim):
    # transformers' GGUF config reader ignores `qwen3.attention.key_length` (Qwen3Config's 128 otherwise).
    path = write_tiny_gguf(tmp_path, "Q4_1", arch="qwen3", head_dim=head_dim)
    assert gguf_config(resolve_model(str(path))).head_dim == head_dim
    engine = engine_for(path, batch_invariant=False)
    assert engine.runner.decoder.int4 and engine.runner.decoder.stack is not None
    assert engine.runner.decoder.layers[0].q_norm is not None and engine.runner.decoder.head_dim == head_dim
    assert engine.quantized.describe() == (
        "model.quantize = auto: int4 (15 layers keep the GGUF's blocks (14 Q4_1, 1 Q8_0); "
        "linear tensors in the file: 14 Q4_1, 1 Q8_0)")
    assert_serves_generate_s_tokens(engine, path)


@pytest.mark.parametrize("embedding", ["Q6_K", "Q4_0", "IQ2_XXS"])  # the last a type no kernel of ponder's runs
def test_an_embedding_of_its_own_keeps_the_file_s_bytes_and_serves_the_tokens_generate_gives(tmp_path, embedding):
    from gguf import GGUFReader

    path = write_tiny_gguf(tmp_path, "Q4_1", embedding=embedding, head="Q8_0", hidden=256, ffn=512)
    reference, expected, model, quantized = both_ways(path)
    assert quantized == expected
    embed = model.model.embed_tokens
    assert isinstance(embed, BlockEmbedding) and embed.kind == embedding
    stored = next(t for t in GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    assert embed.blocks.nbytes == int(stored.n_bytes)  # no float copy: the file's bytes, exactly
    assert np.array_equal(embed.blocks.numpy(), stored.data)
    every_row = torch.arange(model.config.vocab_size)
    assert_same_bits(embed(every_row), reference.model.embed_tokens.weight)  # transformers' float rows
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert_serves_generate_s_tokens(engine_for(path, batch_invariant=False), path)


@pytest.mark.parametrize("head", [None, "Q8_0"])  # the embedding read from the tied head's blocks, or its own
def test_an_embedding_in_blocks_comes_back_from_the_start_up_cache_as_it_was(tmp_path, monkeypatch, caplog, head):
    import logging

    from runtime import startup_cache
    from runtime.model import cached_model

    monkeypatch.setattr(startup_cache, "cache_root", lambda: tmp_path / "cache")
    caplog.set_level(logging.INFO, logger="runtime.model.cached_model")
    path = write_tiny_gguf(tmp_path, "Q4_1", embedding="Q6_K", head=head, hidden=256, ffn=512)
    loads = [cached_model.load_quantized_model(resolve_model(str(path)), torch.device("cpu"), torch.float32, "sdpa",
                                               "auto")[0] for _ in range(2)]  # from the file, then from the cache
    assert caplog.text.count("model loaded from the start-up cache") == 1
    first, cached = (m.model.embed_tokens for m in loads)
    assert type(first) is type(cached) is (HeadRowsEmbedding if head is None else BlockEmbedding)
    if head is None:
        assert cached.head is loads[1].lm_head
    else:
        assert torch.equal(first.blocks, cached.blocks)
    ids = torch.tensor([[1, 5, 6, 7, 8, 95]])
    assert_same_bits(first(ids), cached(ids))
    with torch.no_grad():
        assert torch.equal(loads[0](ids).logits, loads[1](ids).logits)


def test_gemma_s_scaled_embedding_keeps_its_blocks_from_the_file_and_the_start_up_cache(tmp_path, monkeypatch, caplog):
    import logging

    from runtime import startup_cache
    from runtime.model import cached_model

    path = write_tiny_gguf(tmp_path, "Q4_1", arch="gemma3", hidden=96, ffn=192)  # a scale of sqrt(96), not exact
    reference, expected, model, quantized = both_ways(path)
    assert quantized == expected and type(reference.model.embed_tokens).__name__ == "Gemma3TextScaledWordEmbedding"
    embed = model.model.embed_tokens
    assert isinstance(embed, HeadRowsEmbedding) and embed.head is model.lm_head and embed.scale.item() == 96 ** 0.5
    every_row = torch.arange(model.config.vocab_size)
    with torch.no_grad():
        assert_same_bits(embed(every_row) + 0.0, reference.model.embed_tokens(every_row) + 0.0)  # scaled as transformers does
        ids = torch.tensor([[1, 5, 6, 7, 8]])
        assert torch.equal(model(ids).logits, reference(ids).logits)
    monkeypatch.setattr(startup_cache, "cache_root", lambda: tmp_path / "cache")
    caplog.set_level(logging.INFO, logger="runtime.model.cached_model")
    loads = [cached_model.load_quantized_model(resolve_model(str(path)), torch.device("cpu"), torch.float32, "sdpa",
                                               "auto")[0] for _ in range(2)]  # from the file, then from the cache
    assert caplog.text.count("model loaded from the start-up cache") == 1
    assert loads[1].model.embed_tokens.scale.item() == 96 ** 0.5
    with torch.no_grad():
        assert torch.equal(loads[1](ids).logits, reference(ids).logits)
    assert_serves_generate_s_tokens(engine_for(path, batch_invariant=False), path)
