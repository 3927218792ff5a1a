"""Device and dtype choice: bf16 only where the hardware has it (not emulated), and a setting the
machine cannot honour stops start-up with one line naming it, never a silent fallback."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from runtime.model.loader import SettingError, pick_device, pick_dtype


@pytest.fixture
def gpu_without_native_bf16(monkeypatch):
    """A pre-Ampere GPU (T4, V100): torch counts emulated bf16 as supported unless asked not to."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")


def test_auto_dtype_on_a_gpu_without_native_bf16_is_float16(gpu_without_native_bf16):
    assert pick_dtype("auto", torch.device("cuda")) == torch.float16


def test_asking_for_bf16_on_a_gpu_without_it_names_the_setting(gpu_without_native_bf16):
    with pytest.raises(SettingError, match=r"^model\.dtype = bfloat16, but the GPU \(Tesla T4\) has no native"):
        pick_dtype("bfloat16", torch.device("cuda"))
    assert pick_dtype("float16", torch.device("cuda")) == torch.float16


def test_auto_dtype_on_an_ampere_gpu_is_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert pick_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_cpu_dtypes_follow_the_instruction_set(monkeypatch):
    cpu = torch.device("cpu")
    assert pick_dtype("auto", cpu) == torch.float32
    assert pick_dtype("float32", cpu) == torch.float32
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: False)
    for name in ("bfloat16", "float16"):
        with pytest.raises(SettingError, match=rf"^model\.dtype = {name}, but this CPU .* no native {name}"):
            pick_dtype(name, cpu)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert pick_dtype("bfloat16", cpu) == torch.bfloat16


def test_unknown_names_are_refused():
    with pytest.raises(SettingError, match="model.dtype = 'float8'"):
        pick_dtype("float8", torch.device("cpu"))
    with pytest.raises(SettingError, match="model.device = 'tpu'"):
        pick_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_names_the_setting():
    with pytest.raises(SettingError, match=r"^model\.device = cuda, but torch sees no CUDA device"):
        pick_device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_serve_with_cuda_on_a_machine_without_it_stops_with_one_line():
    result = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--device", "cuda", "--port", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ponder: invalid settings: model.device = cuda, but torch sees no")
