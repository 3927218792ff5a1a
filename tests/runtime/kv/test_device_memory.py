"""The generator's KV pool on a GPU, sized from a fraction of the device's memory (runtime.kv.device_memory).

No GPU here: the arithmetic is checked with exact numbers, the GPU path with torch.cuda's memory
query replaced, and the CPU path for being what it was (kv_memory_bytes, or num_blocks).
Tiny llama (tests/conftest): hidden 64, MLP 128, 4 query and 2 KV heads of 16, vocabulary 78, 2 layers,
max_position_embeddings 512; float32, blocks of 4 tokens: 2048 bytes a block.
"""

import pytest
import torch

from runtime import bootstrap
from runtime.bootstrap import build_engine, device_kv_bytes
from runtime.kv.device_memory import activation_reserve, kv_pool_blocks, sizes_from_device
from runtime.model.loader import SettingError
from runtime.wire.options import RuntimeOptions
from server.config import Settings

GIB, MIB = 1 << 30, 1 << 20


def test_the_pool_is_the_fraction_less_what_is_in_use_less_the_reserve():
    # A 24 GiB card, 4 GiB in use (a 7B's weights are more, but the sum is what counts), 1 GiB held
    # back, blocks of 2 MiB (32 layers x K and V x 8 KV heads x 16 tokens x 128 x bf16):
    # int(24 GiB x 0.9) = 23_192_823_398, less 5 GiB = 17_824_114_278 bytes: 8499 whole blocks.
    assert kv_pool_blocks(free=20 * GIB, total=24 * GIB, fraction=0.9, reserve=GIB, bytes_per_block=2 * MIB) == 8499
    # Another process's 6 GiB are in use too: 11_381_663_334 bytes, 5427 blocks.
    assert kv_pool_blocks(14 * GIB, 24 * GIB, 0.9, GIB, 2 * MIB) == 5427
    # The whole device: 19 GiB exactly.
    assert kv_pool_blocks(20 * GIB, 24 * GIB, 1.0, GIB, 2 * MIB) == 19 * 512
    # Already over the fraction: nothing, never a negative count.
    assert kv_pool_blocks(2 * GIB, 24 * GIB, 0.5, 0, 2 * MIB) == 0
    assert kv_pool_blocks(GIB, 2 * GIB, 0.5, 1, 2 * MIB) == 0


def test_the_activation_reserve_counted_by_hand(tiny_llama):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama)
    # One layer, per token: 5 x 64 + q/k/v 128 + rotated q/k 2 x 96 + attention out 64 + 4 x 128 = 1216
    # values, x 2048 tokens x 4 bytes = 9_961_472. A decode group: 2^16 keys x (K and V 2 x 32 x 4 +
    # float32 keys 32 x 4 + scores and weights 2 x 4 heads x 4) = 27_262_976. A prefill chunk's cached
    # K and V over 512 tokens: 2 x 512 x 32 x 4 = 131_072. Logits: 64 rows x 78 x (4 + 3 x 4) = 79_872.
    assert activation_reserve(config, 2048, 64, 512, 4) == 2 * (9_961_472 + 27_262_976 + 131_072 + 79_872)


def test_a_gpu_pool_is_sized_from_the_devices_memory(tiny_llama, monkeypatch):
    """The GPU path, with torch.cuda's memory query replaced: a 1 GiB device with 900 MiB free and a
    fraction of 0.5 leaves 512 MiB - 124 MiB - the reserve (74_870_784) = 331_976_704 bytes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    emptied = []
    monkeypatch.setattr(bootstrap.torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(bootstrap.torch.cuda, "mem_get_info", lambda device: (900 * MIB, GIB))
    options = RuntimeOptions(block_size=4, gpu_memory_fraction=0.5)
    assert device_kv_bytes(options, torch.device("cpu"), model, {}, 512) == 162_098 * 2048
    assert emptied and model._ponder_lean_decoder is not None  # fused before the measurement
    with pytest.raises(SettingError, match=r"cache.gpu_memory_fraction = 0.1: .* leaves no KV cache"):
        device_kv_bytes(RuntimeOptions(block_size=4, gpu_memory_fraction=0.1), torch.device("cpu"), model, {}, 512)
    with pytest.raises(SettingError, match=r"gpu_memory_fraction = 1.5 is not in \(0, 1\]"):
        device_kv_bytes(RuntimeOptions(block_size=4, gpu_memory_fraction=1.5), torch.device("cpu"), model, {}, 512)


def test_only_cuda_without_an_explicit_size_is_sized_from_the_device():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert sizes_from_device(RuntimeOptions(gpu_memory_fraction=0.9), cuda)
    assert not sizes_from_device(RuntimeOptions(gpu_memory_fraction=0.9), cpu)
    assert not sizes_from_device(RuntimeOptions(gpu_memory_fraction=0.9, num_blocks=64), cuda)
    assert not sizes_from_device(RuntimeOptions(), cuda)  # kv_memory_bytes was given: None


def test_the_cpu_pool_is_unchanged(tiny_llama, monkeypatch):
    def no_cuda(*args):
        raise AssertionError("the CPU path asked CUDA for its memory")

    monkeypatch.setattr(bootstrap.torch.cuda, "mem_get_info", no_cuda)
    options = dict(model=str(tiny_llama), device="cpu", block_size=4, kv_memory_bytes=4 << 20)
    engine, _ = build_engine(RuntimeOptions(**options, gpu_memory_fraction=0.9))
    assert engine.pool.num_blocks == (4 << 20) // 2048 == 2048
    engine, _ = build_engine(RuntimeOptions(**options, gpu_memory_fraction=0.9, num_blocks=100))
    assert engine.pool.num_blocks == 100


def test_the_setting_reaches_the_runtime_only_when_no_size_was_given():
    options = Settings.load().runtime_options()
    assert options.gpu_memory_fraction == 0.9 and options.kv_memory_bytes == 2 << 30
    options = Settings.load(cache={"gpu_memory_fraction": 0.75}).runtime_options()
    assert options.gpu_memory_fraction == 0.75 and options.kv_memory_bytes == 2 << 30
    options = Settings.load(cache={"compute_memory_gib": 3.0}).runtime_options()
    assert options.gpu_memory_fraction is None and options.kv_memory_bytes == 3 << 30
    with pytest.raises(ValueError):
        Settings.load(cache={"gpu_memory_fraction": 1.2})


def test_preflight_refuses_a_fraction_outside_0_to_1():
    from runtime.preflight import check

    with pytest.raises(SettingError, match=r"cache.gpu_memory_fraction = 0.0 is not in \(0, 1\]"):
        check(RuntimeOptions(device="cpu", gpu_memory_fraction=0.0))
