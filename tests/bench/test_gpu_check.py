"""The parts of the device check (bench/gpu.py) that run without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import gpu, gpu_models
from storage.kv_cache import KVShape


def test_arguments_and_the_json_s_path():
    args = gpu.parse_args([])
    assert (args.out, args.steps, args.skip_tests, args.no_8b) == (None, 64, False, False)
    args = gpu.parse_args(["--out", "x.json", "--steps", "8", "--skip-tests", "--no-8b"])
    assert (args.out, args.steps, args.skip_tests, args.no_8b) == (Path("x.json"), 8, True, True)
    assert gpu.parse_args(["--dry-run"]).steps == 4 and gpu.parse_args(["--dry-run", "--steps", "9"]).steps == 9
    assert gpu.output_path("NVIDIA H100 80GB HBM3", None) == Path("bench/results/gpu-nvidia-h100-80gb-hbm3.json")
    assert gpu.output_path("NVIDIA H200", Path("a.json")) == Path("a.json")


def test_the_bandwidth_limit():
    # 8B in bfloat16 (16.06e9 bytes) at 3.35e12 bytes/s: 208.6 tokens/s for one stream without KV
    assert gpu.bandwidth_limit(16_060_000_000, 0, 1, 3.35e12) == pytest.approx(208.59, abs=0.01)
    # 16 streams each reading 1e8 bytes of KV: 16 tokens for 16.06e9 + 1.6e9 bytes
    assert gpu.bandwidth_limit(16_060_000_000, 100_000_000, 16, 3.35e12) == pytest.approx(
        16 * 3.35e12 / 17.66e9)
    # Llama-3-8B's KV at 1,000 tokens in bfloat16: 32 layers x 2 x 8 heads x 128 x 2 bytes a token
    shape = KVShape(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
    assert gpu.kv_bytes(shape, 1000, torch.bfloat16) == 131_072_000


def test_a_failing_step_is_recorded_not_skipped():
    report = {"errors": [], "seconds": {}}
    gpu.step(report, "fine", lambda: None)
    gpu.step(report, "broken", lambda: 1 / 0)
    assert report["errors"] == ["broken: ZeroDivisionError: division by zero"]
    assert set(report["seconds"]) == {"fine", "broken"}


def test_only_the_steps_asked_for_run_and_the_others_are_named(tmp_path):
    report = {"errors": [], "seconds": {}}
    steps = gpu.Steps(report, tmp_path / "gpu.json", float("inf"), gpu.parse_args(["--only", "b,c"]).only)
    ran = []
    for name in "abc":
        steps(name, lambda name=name: ran.append(name))
    assert ran == ["b", "c"] and report["left_out"] == ["a"] and set(report["seconds"]) == {"b", "c"}
    assert (tmp_path / "gpu.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
def test_without_a_gpu_it_refuses_loudly():
    with pytest.raises(SystemExit, match="sees no CUDA device"):
        gpu.run(gpu.parse_args(["--skip-tests"]))


def test_the_decode_loop_gives_transformers_greedy_tokens(tiny_llama, monkeypatch):
    """The device check's own decode loop (prompts, then one token a stream a step), on a CPU with the
    normal path: every stream's tokens are transformers' greedy continuation of its prompt."""
    from transformers import AutoModelForCausalLM

    from runtime.model import attention
    from runtime.model.model_runner import ModelRunner
    from storage.kv_cache import KVCache, kv_shape_of
    from tests.runtime.engine_helpers import hf_greedy

    attention.register()
    monkeypatch.setattr(gpu, "PROMPT_TOKENS", 6)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    runner = ModelRunner(model, KVCache(kv_shape_of(model.config, 16), 8, torch.float32, torch.device("cpu")))
    out = gpu.decode(runner, 2, 3, seed=1)
    assert len(out["logits"]) == 4 and out["tokens_per_s"] > 0
    prompts = [seq_tokens[:6] for seq_tokens in _prompts(model.config.vocab_size, 2, 1)]
    # the prompts' step and 3 timed steps each append a token (the last step's logits are not sampled)
    assert out["tokens"] == [hf_greedy(model, p, 4) for p in prompts]


def _prompts(vocab, streams, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (6,), generator=generator).tolist() for _ in range(streams)]


def test_random_4_bit_blocks_replace_every_linear_layer(tiny_llama):
    from transformers import AutoModelForCausalLM

    from runtime.model.gpu_blocks import GpuBlockLinear

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    shapes = {name: tuple(m.weight.shape) for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    file_bytes = gpu_models.random_q4_blocks(model)
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, GpuBlockLinear)}
    assert set(blocks) == set(shapes) and not any(type(m) is torch.nn.Linear for m in model.modules())
    assert file_bytes == sum(o * i * 9 // 16 for o, i in shapes.values())  # 4.5 bits a weight
    layer = blocks["lm_head"]
    assert layer.weight.dtype == torch.uint8 and layer.packed and layer.weight.shape[1] * 2 == shapes["lm_head"][1]
    # Q4_K's scales as the file holds them: int8 a 32 inputs, float32 a 256 (one a row for these 64 inputs)
    assert layer.d.shape == (shapes["lm_head"][0], shapes["lm_head"][1] // 32) and layer.d.dtype == torch.int8
    assert layer.d_super.shape == (shapes["lm_head"][0], 1) and torch.equal(layer.m, -(layer.d // 2))
    assert torch.equal(layer.m_super, 15 * layer.d_super)


def test_the_random_moe_is_every_weight_made_and_its_routed_layers_the_triton_loop_s():
    """The device check's Qwen3-MoE (bench.gpu_q4) in its tiny dry-run shapes: nothing left on the meta
    device, every linear layer 4-bit blocks, each layer's experts stacked with each expert's layers views
    of the stack, the router a kernel layer; the lean decoder's Triton loop takes every layer."""
    from bench.gpu_q4 import TINY_MOE, random_moe_q4
    from runtime.model.decoder import LeanDecoder
    from runtime.model.gpu_blocks import GpuBlockLinear
    from runtime.model.gpu_experts import GpuExperts, GpuFloatLinear

    model, expert_bytes = random_moe_q4(torch.device("cpu"), TINY_MOE, torch.float32)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    experts, hidden, inner = TINY_MOE["num_experts"], TINY_MOE["hidden_size"], TINY_MOE["moe_intermediate_size"]
    for layer in model.model.layers:
        block = layer.mlp.experts
        assert isinstance(block, GpuExperts) and isinstance(layer.mlp.gate.linear, GpuFloatLinear)
        gate_up, down = block.stacks
        assert gate_up.codes.shape == (experts, 2 * inner, hidden // 2) and down.codes.shape == (experts, hidden, inner // 2)
        assert block.down[3].weight.data_ptr() == down.codes[3].data_ptr()
        assert isinstance(block.gate_up[0], GpuBlockLinear) and block.gate_up[0].packed
    # codes half a byte, int8 d and m a 32 inputs, float32 d and m a row (under 256 inputs)
    per_expert = sum(o * i // 2 + 2 * o * i // 32 + 2 * 4 * o for o, i in ((2 * inner, hidden), (hidden, inner)))
    assert expert_bytes == TINY_MOE["num_hidden_layers"] * experts * per_expert
    assert LeanDecoder.build(model).use_gpu_layers()


def test_head_wise_figures_stream_a_tenth_of_the_kv_to_the_resident_tokens():
    """The device check's HeadInfer step (bench.gpu_seeds) on the CPU with a tiny model: the pool holds
    about a tenth of the request's blocks, and the streamed tokens are the resident run's and
    transformers' `generate`'s."""
    from bench import gpu_seeds
    from bench.gpu_models import TINY

    report = {"errors": []}
    gpu_seeds.headwise(report, torch.device("cpu"), torch.float32, gpu_seeds.tokenizer_from(None), TINY, dry=True)
    figures = report["headwise"]
    assert report["errors"] == [] and figures["outputs_identical"] is True
    assert figures["pool_blocks"] == -(-figures["request_blocks"] // 10)
    assert figures["offloaded"]["bytes_into_compute"] > 0 and figures["resident"]["bytes_into_compute"] == 0


def test_the_sweep_chooses_a_tile_that_keeps_a_row_s_bits(monkeypatch):
    """The device check's matmul sweep (bench.gpu_sweep) on the CPU, in Triton's interpreter: every tile
    is checked to keep a row's bits, and the one chosen for each shape is the kernel's for that shape."""
    from bench.gpu_models import TINY
    from bench.gpu_sweep import linear_sweep
    from runtime.kernels.gpu import linear
    from runtime.model.gpu_tiles import describe

    monkeypatch.setattr(linear, "CHOSEN", {})
    report = {"errors": []}
    shapes = {**TINY, "vocab_size": 32, "hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 2,
              "num_key_value_heads": 1}
    tiles = ((16, 64, 4), (32, 32, 4), (16, 32, 4, 1, 16), (16, 64, 4, 1, 1, 1), (16, 64, 4, 1, 16, 1))
    linear_sweep(report, torch.device("cpu"), shapes, torch.float32, rows_set=(1, 6), tiles=tiles)
    sweep = report["linear_sweep"]
    assert set(sweep) == {"qkv", "o", "gate_up", "down", "head"} and report["errors"] == []
    for name, entry in sweep.items():
        assert all(entry["rows_keep_their_bits"].values())
        assert entry["chosen_tile"] == describe(linear.CHOSEN[(*entry["shape"], True)])
        assert set(entry["q4_rows_1"]) == {"x".join(map(str, tile)) for tile in tiles}
        assert set(entry["triton_float_rows_1"]) == {"x".join(map(str, tile)) for tile in tiles[:3]}  # (blocks only)
    # o and gate/up are both 64 x 64 here: one tile for the shape, the first layer's, whatever the timings
    assert sweep["o"]["shape"] == sweep["gate_up"]["shape"] and sweep["gate_up"]["chosen_by"] == "o"
    assert "chosen_by" not in sweep["o"]


def test_the_embedded_gguf_with_its_blocks_kept_on_the_device(tmp_path, monkeypatch):
    """The step's model: the loader's GPU path (here on the CPU), every linear layer a block layer."""
    from runtime.model import loader
    from runtime.model.gpu_blocks import GpuBlockLinear
    from tests.gguf_model import write_tiny_gguf

    path = write_tiny_gguf(tmp_path, "Q4_1")
    monkeypatch.setattr(loader, "resolve_model", lambda model: loader.ModelSource("tiny", str(tmp_path), path.name))
    report: dict = {}
    model = gpu_models.embedded_blocks_model(torch.device("cpu"), torch.float32, report)
    layers = [m for m in model.modules() if isinstance(m, GpuBlockLinear)]
    assert len(layers) == 15 and all(m.packed for m in layers[:-1]) and not model.lm_head.packed  # a Q8_0 head
    assert report["embedded_blocks"].startswith("model.quantize = auto: gpu_blocks (15 layers keep the GGUF's blocks")
