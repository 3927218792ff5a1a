"""The block GEMM's tiles chosen at start-up for the layer shapes a model launches (runtime.model.gpu_tiles),
here on the CPU in Triton's interpreter with a stand-in clock: the launched layers found, a tile that
changes a row's bits never chosen, the choice set for the kernel, kept in the start-up cache and read back."""

from __future__ import annotations

import itertools

import pytest
import torch

from runtime.kernels.gpu import linear
from runtime.model import gpu_tiles
from runtime.model.cached_model import gguf_config
from runtime.model.decoders import build_decoder
from runtime.model.gguf_load import load_gguf_blocks
from runtime.model.gpu_blocks import GpuBlockLinear
from runtime.model.loader import load_causal_lm, resolve_model
from tests.gguf_model import write_tiny_gguf
from tests.runtime.gpu_path.test_gpu_blocks_load import MIXED

CPU = torch.device("cpu")
TILES = ((8, 64, 4), (16, 32, 4, 1, 16))  # (one row a program; a tensor-core tile)


@pytest.fixture
def tiny(tmp_path):
    path = write_tiny_gguf(tmp_path, "Q4_1", kinds=MIXED)
    source = resolve_model(str(path))
    model, _ = load_gguf_blocks(source, gguf_config(source), torch.float32, "sdpa", device=CPU)
    return source, model, build_decoder(model)


def faster_second(times=(2.0,) * len(gpu_tiles.ROWS) + (1.0,) * len(gpu_tiles.ROWS)):
    """A clock under which the second of two tiles is the faster at every row count (calls in tile order)."""
    ticks = itertools.cycle(times)
    return lambda fn: (fn(), next(ticks))[1]


def test_the_launched_layers_are_the_fused_ones_o_down_and_the_head(tiny):
    _, model, decoder = tiny
    launched = gpu_tiles.launched_layers(model, decoder)
    layers = model.model.layers
    expected = [model.lm_head]
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        # q, k and v of three forms side by side (each launched); gate and up fused into one new layer
        expected += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, decoder.layers[i].gate_up.fused, mlp.down_proj]
    assert sorted(map(id, launched)) == sorted(map(id, expected))
    assert all(isinstance(layer, GpuBlockLinear) for layer in launched)
    assert not {id(layer.mlp.gate_proj) for layer in layers} & set(map(id, launched))


def test_the_tiles_chosen_are_set_cached_and_read_back_and_keep_the_logits(tiny, tmp_path, monkeypatch):
    source, model, decoder = tiny
    monkeypatch.setattr(linear, "CHOSEN", {})
    chosen = gpu_tiles.tune(model, decoder, torch.float32, timer=faster_second(), tiles=TILES, root=tmp_path / "cache")
    keys = {gpu_tiles.key_of(layer) for layer in gpu_tiles.launched_layers(model, decoder)}
    assert set(chosen) == keys and set(chosen.values()) == {((1, TILES[1]),)} and linear.CHOSEN == chosen
    [entry] = (tmp_path / "cache" / "gpu_tiles").iterdir()
    assert (entry / "tiles.json").exists()

    def no_clock(fn):
        raise AssertionError("a cached choice is read, not timed again")

    monkeypatch.setattr(linear, "CHOSEN", {})
    assert gpu_tiles.tune(model, decoder, torch.float32, timer=no_clock, tiles=TILES, root=tmp_path / "cache") == chosen
    assert linear.CHOSEN == chosen
    # the layers now compute with the tensor-core tile: still the file's weights
    reference = load_causal_lm(source, CPU, torch.float32, "sdpa")
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_tile_that_changes_a_row_s_bits_in_a_batch_is_never_chosen(tiny, monkeypatch):
    _, model, decoder = tiny
    layer = model.lm_head
    plain = gpu_tiles._call

    def call(layer, tile):
        if tile == TILES[1]:  # (a stand-in kernel whose rows depend on how many there are)
            return lambda x: plain(layer, tile)(x) + len(x)
        return plain(layer, tile)

    monkeypatch.setattr(gpu_tiles, "_call", call)
    ranked = gpu_tiles.rank_tiles(layer, torch.float32, TILES, timer=faster_second())
    assert [ranked[tile]["kept"] for tile in TILES] == [True, False]
    assert ranked[TILES[1]]["ms"] == {1: 1.0, 4: 1.0, 16: 1.0}  # the faster, yet not chosen
    assert gpu_tiles.choose(ranked) == ((1, TILES[0]),)
    assert gpu_tiles.choose({TILES[1]: ranked[TILES[1]]}) is None


def test_the_tile_chosen_is_the_one_nearest_the_fastest_at_every_row_count():
    """A one-row tile 10 % faster alone but 8x slower at sixteen rows loses to the tile best at sixteen;
    one 3x slower alone loses to a tile within 1.5x at both."""
    ranked = lambda times: {tile: {"kept": True, "ms": {1: a, 16: b}} for tile, (a, b) in times.items()}  # noqa: E731
    choose = lambda times: dict(gpu_tiles.choose(ranked(times)))  # noqa: E731 - (one tile: {1: it})
    assert choose({(8, 512, 4): (1.0, 8.0), (64, 128, 4, 1, 16): (1.1, 1.0)}) == {1: (64, 128, 4, 1, 16)}
    assert choose({(8, 512, 4): (1.0, 1.5), (64, 128, 4, 1, 16): (3.0, 1.0)}) == {1: (8, 512, 4)}
    # each of two tiles best at one row count, 2x off at the other: a third within 1.5x of both wins
    assert choose({(8, 512, 4): (1.0, 3.0), (4, 1024, 4): (2.0, 1.5), (16, 256, 4): (1.5, 2.0)}) == {1: (16, 256, 4)}
    # equal worst ratios: the least summed time
    assert choose({(8, 512, 4): (1.0, 3.0), (4, 1024, 4): (3.0, 1.0), (32, 128, 4): (2.0, 2.0),
                   (16, 256, 4): (2.0, 1.5)}) == {1: (16, 256, 4)}


GEMV8, TILE8, SPLIT8 = (16, 256, 4, 1, 1, 1), (64, 128, 4, 1, 16, 1), (64, 256, 8, 4, 16, 1)  # (int8 inputs)


def test_int8_tiles_of_one_order_are_chosen_each_from_the_row_count_it_is_fastest_at():
    """The same bits (one order) let a GEMV take a stream alone and the tensor cores a search's beams; tiles
    of another order never join them, and a tile alone still wins where it is nearer the best everywhere."""
    def ranked(times, orders):
        return {tile: {"kept": True, "ms": dict(zip((1, 4, 16), ms)), "order": orders.get(tile, tile)}
                for tile, ms in times.items()}
    times = {(8, 512, 4): (1.2, 2.0, 4.0), GEMV8: (1.0, 2.0, 8.0), TILE8: (2.0, 2.0, 1.0)}
    assert gpu_tiles.choose(ranked(times, {TILE8: GEMV8})) == ((1, GEMV8), (16, TILE8))
    assert gpu_tiles.choose(ranked(times, {})) == ((1, TILE8),)  # (another order: no steps between them)
    # a float tile within 1.25x everywhere beats the steps' worst of 1.6x (at four rows)
    times = {(8, 512, 4): (1.2, 1.25, 1.25), GEMV8: (1.0, 2.0, 8.0), TILE8: (2.0, 2.0, 1.0)}
    assert gpu_tiles.choose(ranked(times, {TILE8: GEMV8})) == ((1, (8, 512, 4)),)


def test_int8_tiles_are_grouped_by_the_bits_they_give_and_chosen_by_rows(tiny, tmp_path, monkeypatch):
    """With int8 inputs a GEMV and a tensor-core tile give a row the same bits: measured on a real layer, so
    they are one order, the steps set for the kernel take each at its rows, and every row keeps its bits."""
    source, model, decoder = tiny
    layer = model.model.layers[0].mlp.down_proj
    ranked = gpu_tiles.rank_tiles(layer, torch.float32, (GEMV8, TILE8, SPLIT8), timer=lambda fn: 1.0)
    assert [ranked[tile]["order"] for tile in (GEMV8, TILE8, SPLIT8)] == [GEMV8, GEMV8, SPLIT8]
    assert all(entry["kept"] for entry in ranked.values())
    clock = itertools.cycle((1.0, 1.0, 3.0, 2.0, 2.0, 1.0))  # (the GEMV at 1 and 4 rows, the tile at 16)
    monkeypatch.setattr(linear, "CHOSEN", {})
    chosen = gpu_tiles.tune(model, decoder, torch.float32, timer=lambda fn: next(clock), tiles=(GEMV8, TILE8),
                            root=tmp_path / "cache")
    assert set(chosen.values()) == {((1, GEMV8), (16, TILE8))}
    key = gpu_tiles.key_of(layer)
    assert [linear.tile_for(key, rows) for rows in (1, 15, 16, 40)] == [GEMV8, GEMV8, TILE8, TILE8]
    x = torch.randn(17, layer.in_features)
    whole = layer.rows(x)
    assert all(torch.equal(layer.rows(x[i:i + 1]), whole[i:i + 1]) for i in (0, 16))
    # int8 inputs as the CPU's block kernels quantize them: the CPU's logits within float32 rounding (the
    # float weights' are up to 0.13 away here, the CPU's as far)
    cpu, _ = load_gguf_blocks(source, gguf_config(source), torch.float32, "sdpa")
    monkeypatch.setattr(linear, "TILE", GEMV8)  # (transformers' forward runs gate and up apart: not tuned)
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, cpu(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_qwen3_5_file_s_launched_layers_are_its_fused_runs_too(tmp_path):
    """A hybrid decoder's delta layers fuse runs of their input projections: each run's fused layer is
    timed, not its parts (a Qwen3.5 replica's Q8_0 file loaded for a GPU, on the CPU)."""
    from transformers import AutoModelForCausalLM

    from runtime.model.gpu_blocks import SideBySide
    from tests.gguf_qwen35 import write_qwen35_gguf
    from tests.replicas.hybrid import write_qwen35

    reference = AutoModelForCausalLM.from_pretrained(write_qwen35(tmp_path / "replica"), dtype=torch.float32)
    path = write_qwen35_gguf(reference.config.to_dict(), reference.state_dict(), tmp_path / "q35.gguf", kind="Q8_0")
    source = resolve_model(str(path))
    model, _ = load_gguf_blocks(source, gguf_config(source), torch.float32, "sdpa", device=CPU)
    decoder = build_decoder(model)
    launched = set(map(id, gpu_tiles.launched_layers(model, decoder)))
    runs = [p for layer in decoder.layers for p in gpu_tiles._projections(layer)]
    delta = [layer for layer in decoder.layers if hasattr(layer, "in_proj")]
    assert delta and all(run in runs for layer in delta for run in layer.in_proj.runs)
    assert any(len(run.layers) > 1 for layer in delta for run in layer.in_proj.runs)  # (a run fused into one layer)
    for projections in runs:
        if projections.fused is None or isinstance(projections.fused, SideBySide):
            continue
        assert id(projections.fused) in launched
        assert not {id(part) for part in projections.layers if part is not projections.fused} & launched


def test_a_tile_that_does_not_run_here_is_left_out(tiny, monkeypatch, caplog):
    _, model, _ = tiny
    plain = gpu_tiles._call

    def call(layer, tile):
        if tile == TILES[1]:
            def refused(x):
                raise RuntimeError("no bf16 tensor cores on this GPU")
            return refused
        return plain(layer, tile)

    monkeypatch.setattr(gpu_tiles, "_call", call)
    ranked = gpu_tiles.rank_tiles(model.lm_head, torch.float32, TILES, timer=faster_second())
    assert list(ranked) == [TILES[0]] and gpu_tiles.choose(ranked) == ((1, TILES[0]),)
    assert "does not run here" in caplog.text
