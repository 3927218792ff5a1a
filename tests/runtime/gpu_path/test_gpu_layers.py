"""The GPU path's wiring run on a CPU in Triton's interpreter: the runner's decode steps through the Triton
layer loop (runtime.model.gpu_layers) and the Triton decode attention give the tokens the normal path gives."""

from __future__ import annotations

import pytest
import torch

from runtime.model import gpu_layers
from tests.runtime.engine_helpers import engine_for, request, run

PROMPTS = [[1, 5, 6, 7, 8], [1, 40]]


def requests():
    return [request("greedy", PROMPTS[0], max_tokens=3),
            request("sampled", PROMPTS[1], max_tokens=3, temperature=0.8, seed=3, n=2)]


def counting_gpu_steps(monkeypatch):
    seen = []
    call = gpu_layers.GpuLayers.__call__

    def counted(self, hidden, *args, **kwargs):
        seen.append(hidden.shape[0])
        return call(self, hidden, *args, **kwargs)

    monkeypatch.setattr(gpu_layers.GpuLayers, "__call__", counted)
    return seen


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    from tests.runtime.model.test_decoder_gemma3 import write_gemma3

    return write_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


# llama; Qwen3 (per-head norms before the rotary); Gemma 3 (its (1 + w) norms, four a layer, GELU, two rotaries)
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3", "tiny_gemma3"])
def test_triton_decode_steps_give_the_normal_path_s_tokens(request_fixture_value, model, monkeypatch):
    path = request_fixture_value(model)
    expected = run(engine_for(path, quantize="none", num_blocks=32), requests())
    engine = engine_for(path, quantize="none", num_blocks=32)
    engine.runner.use_gpu_kernels()
    assert engine.runner.decoder.gpu is not None
    steps = counting_gpu_steps(monkeypatch)
    assert run(engine, requests()) == expected
    # Every step decodes (exact prefill attends prompt tokens one query at a time too): all in Triton
    assert len(steps) == 3


def test_gemma3_decodes_past_its_window_in_triton_to_the_normal_path_s_tokens(tiny_gemma3, monkeypatch):
    """Gemma 3's sliding layers (a window of 8, their own rotary) and its global layer, decoding from a
    30-token prompt: every decode step in the Triton loop, the normal path's tokens."""
    from tests.runtime.model.test_decoder_gemma3 import LONG_PROMPT

    asked = lambda: [request("long", LONG_PROMPT, max_tokens=12),  # noqa: E731
                     request("sampled", PROMPTS[0], max_tokens=6, temperature=0.8, seed=5, n=2)]
    expected = run(engine_for(tiny_gemma3, quantize="none", num_blocks=64), asked())
    engine = engine_for(tiny_gemma3, quantize="none", num_blocks=64)
    engine.runner.use_gpu_kernels()
    gpu = engine.runner.decoder.gpu
    assert gpu is not None and gpu.offset and gpu.gelu
    steps = counting_gpu_steps(monkeypatch)
    assert run(engine, asked()) == expected
    assert len(steps) == 12


def test_gemma3_s_static_buffer_steps_hold_its_sliding_layers_own_cache(tiny_gemma3, monkeypatch):
    """The step a CUDA graph replays, run eagerly, for Gemma 3 with its sliding layers' KV apart: slots and
    tables for both caches (blocks before the window released, read as that cache's scratch block), the
    normal path's tokens."""
    from tests.runtime.model.test_decoder_gemma3 import LONG_PROMPT

    asked = lambda: [request("long", LONG_PROMPT, max_tokens=10),  # noqa: E731
                     request("sampled", PROMPTS[0], max_tokens=4, temperature=0.8, seed=5, n=2)]
    released = []

    def seen(engine):  # the long prompt's blocks before its window, released
        running = engine.scheduler.running
        released.append(sum(b is None for b in running[0].window_table) if running else 0)

    engine, sizes = static_steps(tiny_gemma3, asked, monkeypatch, seen, num_blocks=64)
    assert engine.runner.window is not None and len(engine.runner.graphs.parts) == 2  # (both caches' slots)
    assert len(sizes) == 9 and max(released) > 0  # (every decode step)


def test_without_padding_prompts_prefill_in_torch_and_decode_steps_run_in_triton(tiny_llama, monkeypatch):
    expected = run(engine_for(tiny_llama, quantize="none", batch_invariant=False), requests())
    engine = engine_for(tiny_llama, quantize="none", batch_invariant=False)
    engine.runner.use_gpu_kernels()
    steps = counting_gpu_steps(monkeypatch)
    assert run(engine, requests()) == expected
    assert steps == [3] * 2  # the prefill step is SDPA's; then three rows a step, each step in Triton


def decode_launches(engine, monkeypatch, asked, kernels=("rms_norm", "attention_inputs", "decode_attention", "act_mul"),
                    functions=()) -> list[list[str]]:
    """What each step of the Triton loop ran while `engine` served `asked`, in order: each of `kernels`
    (gpu_layers' names) and of `functions` ((module, name): a kernel's wrapper that its callers import
    at each call) by its name, and every torch operator outside them that is not a view or an
    allocation (a matmul, a fill)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    launches, inside = [], []

    def counted_call(run_, name):
        def kernel(*args, **kwargs):
            launches.append(name)
            inside.append(name)
            try:
                return run_(*args, **kwargs)
            finally:
                inside.pop()
        return kernel

    for name in kernels:
        monkeypatch.setattr(gpu_layers, name, counted_call(getattr(gpu_layers, name), name))
    for module, name in functions:
        monkeypatch.setattr(module, name, counted_call(getattr(module, name), name))
    free = {"aten.empty.memory_format", "aten.view.default", "aten.slice.Tensor", "aten.t.default",
            "aten._unsafe_view.default", "aten.detach.default", "aten.alias.default",
            "aten.reshape.default"}  # (the step's cos and sin to [T, D]: views of the decoder's)

    class Operators(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside and str(func) not in free:
                launches.append(str(func))
            return func(*args, **(kwargs or {}))

    steps, call = [], gpu_layers.GpuLayers.__call__

    def counted(self, *args, **kwargs):
        launches.clear()
        with Operators():
            out = call(self, *args, **kwargs)
        steps.append(list(launches))
        return out

    monkeypatch.setattr(gpu_layers.GpuLayers, "__call__", counted)
    engine.runner.attention_kernel = gpu_layers.decode_attention  # (the counted kernel: `covers` asks for it)
    run(engine, asked)
    return steps


@pytest.fixture
def request_fixture_value(request):
    return request.getfixturevalue


def static_steps(path, asked, monkeypatch, seen=None, **options):
    """An engine whose pure decode steps run the static-buffer step eagerly (a CUDA graph's CPU twin), its
    results asserted equal to the normal path's; returns it and each such step's padded size (`seen(engine)`
    called at each)."""
    from runtime.model.graphs import DecodeGraphs

    expected = run(engine_for(path, quantize="none", **options), asked())
    engine = engine_for(path, quantize="none", **options)
    engine.runner.use_gpu_kernels()
    assert engine.runner.use_graphs(capture=False, max_rows=4)
    sizes, step = [], DecodeGraphs._step

    def counted(self, size):
        sizes.append(size)
        if seen is not None:
            seen(engine)
        return step(self, size)

    monkeypatch.setattr(DecodeGraphs, "_step", counted)
    assert run(engine, asked()) == expected
    return engine, sizes


def test_the_static_buffer_decode_step_gives_the_eager_path_s_tokens(tiny_llama, monkeypatch):
    """The step a CUDA graph replays, run eagerly on the CPU (its twin): pure decode steps from the static
    buffers at padded batch sizes, the same tokens as the normal path."""
    engine, sizes = static_steps(tiny_llama, requests, monkeypatch, num_blocks=32)
    # The prompts' step is eager; then two steps of three sequences, each padded as row padding pads 3.
    assert sizes == [engine.runner.padding.pad(3)] * 2


def test_the_static_buffers_follow_a_batch_that_shrinks_and_tables_that_widen(tiny_llama, monkeypatch):
    """Three sequences, then one past the others' end: the rows the host buffers held for the others are
    padded rows again, and the long one's table widens a block every 4 tokens."""
    asked = lambda: [request("long", PROMPTS[0], max_tokens=11),  # noqa: E731
                     request("sampled", PROMPTS[1], max_tokens=3, temperature=0.8, seed=3, n=2)]
    engine, sizes = static_steps(tiny_llama, asked, monkeypatch, num_blocks=32)
    pad = engine.runner.padding.pad
    assert sizes == [pad(3)] * 2 + [pad(1)] * 8
    # after the last step the rows the others held are padded rows: token 0 at position 0, its KV bound for
    # the scratch block alone (not into the blocks the others freed)
    graphs, scratch = engine.runner.graphs, engine.runner.cache.scratch_block
    assert graphs.input_ids[0, 1:4].tolist() == [0] * 3 and graphs.positions[0, 1:4].tolist() == [0] * 3
    assert graphs.ctx[1:4].tolist() == [1] * 3 and graphs.tables[1:4, 0].tolist() == [scratch] * 3
    padded = engine.runner.cache.row_index(torch.tensor([scratch] * 3), torch.zeros(3, dtype=torch.long))
    assert torch.equal(graphs.slot_rows[:, 1:4], padded)


def test_graphs_need_row_padding_and_the_triton_loop(tiny_llama):
    from runtime.bootstrap import engine_paths

    engine = engine_for(tiny_llama, quantize="none", batch_invariant=False)
    assert not engine.runner.use_graphs(capture=False)  # no Triton kernels asked for
    engine.runner.use_gpu_kernels()
    paths = engine_paths(engine)
    assert (paths["layers"], paths["attention"]) == ("triton", "triton")  # as start-up logs them
    assert not engine.runner.use_graphs(capture=False)  # no row padding: batch invariance off
    assert engine.runner.graphs is None


def test_the_device_check_splits_a_replayed_step_and_leaves_the_graphs_as_they_were(tiny_llama):
    """bench.gpu_split on the graphs' CPU twin: every decode step is timed through the static buffers
    (the fill, then the step the graph would replay), its parts within the step, and the runner's own
    fill and step are back in place after it: the next step runs them, not the timers."""
    from bench.gpu_split import split
    from runtime.model.graphs import DecodeGraphs

    engine = engine_for(tiny_llama, quantize="none", num_blocks=32)
    engine.runner.use_gpu_kernels()
    assert engine.runner.use_graphs(capture=False, max_rows=4)
    graphs = engine.runner.graphs
    out = split(engine.runner, 3, prompt_tokens=6)
    assert out["steps"] == 3 and out["replay_clock"] == "host (the static step run eagerly)"
    assert 0 < out["fill_us"] and 0 < out["replay_us"] and out["fill_us"] + out["replay_us"] <= out["step_us"]
    # (each figure rounded to a tenth on its own: their difference may be a tenth off)
    assert out["other_us"] == pytest.approx(out["step_us"] - out["fill_us"] - out["replay_us"], abs=0.15)
    assert "_fill" not in vars(graphs) and "_step" not in vars(graphs)
    assert type(graphs)._fill is DecodeGraphs._fill


# llama; Qwen3 (its head norms in the attention-inputs kernel too); Qwen2 (a bias on the qkv matmul); Gemma 3
# (each sublayer's output normed in the launch that adds it)
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3", "tiny_qwen2", "tiny_gemma3"])
def test_a_decode_layer_is_nine_launches(request_fixture_value, model, monkeypatch):
    """What a decode step of the Triton loop runs, counted on the CPU: each of ponder's kernels a launch,
    and every torch operator outside them that is not a view or an allocation (a matmul, a fill)."""
    engine = engine_for(request_fixture_value(model), quantize="none", num_blocks=32)
    engine.runner.use_gpu_kernels()
    steps = decode_launches(engine, monkeypatch, [request("greedy", PROMPTS[0], max_tokens=3)])
    layer = ["rms_norm", "aten.linear.default", "attention_inputs", "decode_attention", "aten.linear.default",
             "rms_norm", "aten.linear.default", "act_mul", "aten.linear.default"]
    assert len(steps) == 3  # (the prompt's step too: exact prefill attends each prompt token alone)
    assert steps[-1] == ["aten.zeros.default"] + layer * len(engine.runner.decoder.layers) + ["rms_norm"]
