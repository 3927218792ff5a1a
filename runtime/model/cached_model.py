"""A GGUF model with int4 layers, loaded from the start-up cache (runtime.startup_cache) when it can be.

The first start loads the GGUF (with `quantize = "auto"` tensor by tensor into int layers,
runtime.model.gguf_load; otherwise through transformers, which dequantizes every tensor, and
`apply_quantize`), then saves what it served: the config, and every
parameter and buffer of the finished model (the int4 layers' packed codes and scales, the float
embeddings and norms, the rotary tables) in one safetensors file. A later start builds the model's
skeleton on the meta device from that config, puts int4 layers where the file says, and assigns every
tensor from the file: no float round trip, nothing packed again, the very same bits (tested).

Strict as `runtime.model.loader.load_strictly`: the entry must hold exactly the skeleton's parameters and
buffers, each of its shape, and no tensor may stay on the meta device; an entry that does not is
discarded and rebuilt from the GGUF, which is checked as every start checks it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from runtime.model.block_embedding import BlockEmbedding, HeadRowsEmbedding
from runtime.model.experts import KernelExperts, with_routed_experts
from runtime.model.float_layers import FloatLinear, float_layers
from runtime.model.gguf_qwen35 import InputOrder
from runtime.model.loader import CheckpointMismatch, ModelSource, gguf_model_config, load_causal_lm
from runtime.model.quantize import Int4Linear, Quantized, apply_quantize
from runtime.startup_cache import Entry, file_identity, runtime_sources, sources_hash

log = logging.getLogger(__name__)

_TENSORS = "tensors.safetensors"
_LAYOUT = "layout.json"
_CONFIG = "config"
# The files whose code decides what the cached tensors are.
_CODE = ("model/loader.py", "model/quantize.py", "model/gguf_blocks.py", "model/block_pack.py", "model/gguf_load.py",
         "model/float_layers.py", "model/block_embedding.py", "model/gguf_config.py", "model/cached_model.py",
         "model/experts.py", "model/gguf_experts.py", "model/gguf_qwen35.py", "model/gguf_gpt_oss.py",
         "startup_cache.py")


class CacheMismatch(RuntimeError):
    """A cache entry that does not fill the model it describes exactly."""


def model_entry(source: ModelSource, dtype: torch.dtype, attn_implementation: str, setting: str,
                trust_remote_code: bool) -> Entry:
    return Entry("int4", {"model": file_identity(source.path), "dtype": str(dtype), "quantize": setting,
                          "attention": attn_implementation, "trust_remote_code": trust_remote_code,
                          "code": sources_hash(runtime_sources(*_CODE))})


def is_cacheable(source: ModelSource, device: torch.device, setting: str) -> bool:
    """Only a GGUF model on a CPU whose setting may keep int4 layers is cached; others load as before."""
    from runtime.kernels.cpu_kernels import q4_unavailable

    return source.gguf_file is not None and device.type == "cpu" and setting in ("auto", "int4") \
        and q4_unavailable() is None


def load_quantized_model(source: ModelSource, device: torch.device, dtype: torch.dtype, attn_implementation: str,
                         setting: str, trust_remote_code: bool = False,
                         gpu_blocks: bool | None = None) -> tuple[nn.Module, Quantized]:
    """The model with `setting` applied, from the cache where an entry matches, else from the file (and
    then cached when its layers became int4). `gpu_blocks`: whether a GGUF's linear layers keep its blocks
    for the Triton block GEMM (runtime.model.gpu_blocks) on `device`; None: where the device is a GPU and
    `setting` is auto (the tests set it on a CPU, where the kernels run in Triton's interpreter)."""
    if gpu_blocks is None:
        gpu_blocks = device.type == "cuda" and setting == "auto"
    if gpu_blocks and source.gguf_file is not None:
        from runtime.model.gguf_load import load_gguf_blocks

        try:
            return load_gguf_blocks(source, gguf_config(source, trust_remote_code), dtype, attn_implementation,
                                    trust_remote_code, device=device)
        except CheckpointMismatch as exc:
            log.warning("%s does not keep its blocks on %s (%s); loading it dequantized through transformers",
                        source.path, device.type, exc)
    entry = None
    if is_cacheable(source, device, setting):
        entry = model_entry(source, dtype, attn_implementation, setting, trust_remote_code)
        cached = entry.read(lambda directory: read_model(directory, dtype, attn_implementation, trust_remote_code))
        if cached is not None:
            log.info("model loaded from the start-up cache %s", entry.path)
            return cached
    loaded = None
    if entry is not None and setting == "auto":  # the file's blocks straight into int layers, no float copy
        from runtime.model.gguf_load import load_gguf_blocks

        try:
            loaded = load_gguf_blocks(source, gguf_config(source, trust_remote_code), dtype, attn_implementation,
                                      trust_remote_code)
        except CheckpointMismatch as exc:  # e.g. an architecture whose tensors transformers renames or splits
            log.warning("%s does not load tensor by tensor (%s); loading it through transformers", source.path, exc)
    if loaded is not None:
        model, quantized = loaded
    else:
        model = load_causal_lm(source, device, dtype, attn_implementation, trust_remote_code)
        quantized = apply_quantize(model, setting, source.path if source.gguf_file else None)
        if setting == "auto" and not source.gguf_file and device.type == "cpu":
            quantized = float_layers(model, setting)
        quantized = with_routed_experts(model, quantized)  # (runtime.model.experts)
    # (a model with routed experts in kernel layers, runtime.model.experts, is not cached: its skeleton
    # from the config holds transformers' stacked experts, which the entry's tensors would not fill)
    # (nor one with a layer gathering its input into the file's column order, runtime.model.gguf_qwen35)
    holds_experts = any(isinstance(module, (KernelExperts, InputOrder)) for module in model.modules())
    if entry is not None and quantized.mode in ("int4", "float") and not holds_experts and \
            entry.write(lambda directory: write_model(directory, model, quantized)):
        log.info("model saved to the start-up cache %s", entry.path)
    return model, quantized


def gguf_config(source: ModelSource, trust_remote_code: bool = False):
    """A GGUF's config (runtime.model.loader.gguf_model_config: from the file's own metadata where
    ponder reads its architecture, else as transformers reads it), from the start-up cache once read:
    reading it parses metadata fields of the file (transformers' reading every one, the vocabulary and
    merges included: seconds; 20 s on a loaded 2-core machine), where the saved config.json loads in
    milliseconds. For the start-up settings check (runtime.preflight), which needs the config only."""
    from transformers import AutoConfig

    entry = Entry("config", {"model": file_identity(source.path), "trust_remote_code": trust_remote_code,
                             "code": sources_hash(runtime_sources("model/cached_model.py", "model/gguf_config.py",
                                                                  "model/loader.py", "startup_cache.py"))})
    cached = entry.read(lambda directory: AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code))
    if cached is not None:
        cached.name_or_path = source.directory
        return cached
    config = gguf_model_config(source, trust_remote_code)
    entry.write(config.save_pretrained)
    return config



def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not) by qualified name."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def write_model(directory: Path, model: nn.Module, quantized: Quantized) -> None:
    int4 = {name: {"in_features": module.in_features, "out_features": module.out_features,
                   "zero_points": module.m is not None, "bias": module.bias is not None}
            for name, module in model.named_modules() if isinstance(module, Int4Linear)}
    floats = {name: {"in_features": module.in_features, "out_features": module.out_features,
                     "dtype": str(module.weight.dtype).removeprefix("torch."), "bias": module.bias is not None}
              for name, module in model.named_modules() if isinstance(module, FloatLinear)}
    modules = dict(model.named_modules())
    embeddings = {name: {"kind": m.kind, "shape": list(m.blocks.shape), "dim": m.embedding_dim}
                  for name, m in modules.items() if isinstance(m, BlockEmbedding)}
    embeddings.update({name: {"head": next(n for n, h in modules.items() if h is m.head)}
                       for name, m in modules.items() if isinstance(m, HeadRowsEmbedding)})
    for name, spec in embeddings.items():  # Gemma's row scale, a float64 (exact as a JSON number)
        spec["scale"] = None if modules[name].scale is None else modules[name].scale.item()
    tensors = {name: tensor.detach().contiguous() for name, tensor in _tensors(model).items()}
    shared = {}
    for name, tensor in tensors.items():  # safetensors stores no tensor twice: later names point to the first
        shared.setdefault((tensor.data_ptr(), tensor.shape, tensor.dtype), []).append(name)
    aliases = {name: names[0] for names in shared.values() for name in names[1:]}
    save_tensors({name: t for name, t in tensors.items() if name not in aliases}, directory / _TENSORS)
    model.config.save_pretrained(directory / _CONFIG)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(directory / _CONFIG)
    layout = {"int4": int4, "float": floats, "embeddings": embeddings, "aliases": aliases, "name_or_path": model.config.name_or_path, "quantized": [quantized.setting, quantized.mode, quantized.layers,
                                                              quantized.detail, list(quantized.block_types)]}
    (directory / _LAYOUT).write_text(json.dumps(layout))


@torch.no_grad()
def read_model(directory: Path, dtype: torch.dtype, attn_implementation: str,
               trust_remote_code: bool) -> tuple[nn.Module, Quantized]:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    layout = json.loads((directory / _LAYOUT).read_text())
    config = AutoConfig.from_pretrained(directory / _CONFIG, trust_remote_code=trust_remote_code)
    config.name_or_path = layout["name_or_path"]  # the model's own, not the cache's directory
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation,
                                                 trust_remote_code=trust_remote_code)
    if (directory / _CONFIG / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory / _CONFIG)
    modules = dict(model.named_modules())
    for name, spec in layout["int4"].items():
        parent_name, _, attribute = name.rpartition(".")
        placeholder = Int4Linear.from_packed(spec["in_features"], spec["out_features"], *_meta_int4(spec))
        setattr(modules[parent_name] if parent_name else model, attribute, placeholder)
    for name, spec in layout.get("float", {}).items():  # the weights in the file's type, as cached
        parent_name, _, attribute = name.rpartition(".")
        bias = nn.Parameter(torch.empty(spec["out_features"], device="meta")) if spec["bias"] else None
        weight = torch.empty(spec["out_features"], spec["in_features"], dtype=getattr(torch, spec["dtype"]), device="meta")
        placeholder = FloatLinear.from_weight(weight, bias)
        setattr(modules[parent_name] if parent_name else model, attribute, placeholder)
    for name, spec in layout.get("embeddings", {}).items():  # kept in the GGUF's blocks
        parent_name, _, attribute = name.rpartition(".")
        scale = None if spec.get("scale") is None else torch.tensor(spec["scale"], dtype=torch.float64)
        if "head" in spec:
            placeholder = HeadRowsEmbedding(model.get_submodule(spec["head"]), dtype, scale)  # its int4 placeholder
        else:
            blocks = torch.empty(spec["shape"], dtype=torch.uint8, device="meta")
            placeholder = BlockEmbedding(spec["kind"], blocks, spec["dim"], dtype, scale)
        setattr(modules[parent_name] if parent_name else model, attribute, placeholder)
    tensors = load_tensors(directory / _TENSORS)
    for name, first in layout["aliases"].items():
        tensors[name] = tensors[first]
    _assign(model, tensors)
    setting, mode, layers, detail, block_types = layout["quantized"]
    return model.eval(), Quantized(setting, mode, layers, detail, tuple(block_types))


# The safetensors format, written and read a tensor at a time: safetensors' own save_file makes a
# bytes copy of every tensor before writing and load_file maps the file, so either would hold the
# model twice at its peak.
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.uint8: "U8", torch.int8: "I8",
           torch.int32: "I32", torch.int64: "I64", torch.float64: "F64", torch.bool: "BOOL"}


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    header, offset = {}, 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as file:
        file.write(len(text).to_bytes(8, "little") + text)
        for tensor in tensors.values():
            if tensor.numel():
                file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    dtypes = {code: dtype for dtype, code in _DTYPES.items()}
    tensors = {}
    with open(path, "rb") as file:
        size = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(size))
        header.pop("__metadata__", None)
        for name, spec in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            tensor = torch.empty(spec["shape"], dtype=dtypes[spec["dtype"]])
            start, end = spec["data_offsets"]
            file.seek(8 + size + start)
            if tensor.numel() and file.readinto(tensor.reshape(-1).view(torch.uint8).numpy().data) != end - start:
                raise CacheMismatch(f"{name} is cut short in {path}")
            tensors[name] = tensor
    return tensors


def _meta_int4(spec: dict) -> tuple:
    """Meta tensors standing for an int4 layer's buffers until the cached ones are assigned."""
    meta = torch.empty(0, device="meta")
    bias = nn.Parameter(torch.empty(spec["out_features"], device="meta")) if spec["bias"] else None
    return meta, meta, meta if spec["zero_points"] else None, bias


def _assign(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Give every parameter and buffer of `model` its tensor from `tensors`; raises CacheMismatch unless
    the names match exactly, the float shapes agree, and no tensor is left on the meta device."""
    expected = _tensors(model)
    missing, unexpected = sorted(expected.keys() - tensors.keys()), sorted(tensors.keys() - expected.keys())
    if missing or unexpected:
        raise CacheMismatch(f"the entry lacks {missing[:3]} and holds {unexpected[:3]} nothing reads")
    parameters = dict(model.named_parameters(remove_duplicate=False))
    by_tensor: dict[int, torch.Tensor] = {}  # tied parameters stay tied: one new tensor per old one
    for name, tensor in tensors.items():
        old = expected[name]
        if old.numel() and (old.shape != tensor.shape or old.dtype != tensor.dtype):
            raise CacheMismatch(f"{name} is {tuple(tensor.shape)} {tensor.dtype}, the model wants "
                                f"{tuple(old.shape)} {old.dtype}")
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if name in parameters:
            new = by_tensor.setdefault(id(old), nn.Parameter(tensor, requires_grad=old.requires_grad))
            parent._parameters[attribute] = new
        else:
            parent._buffers[attribute] = tensor
    left = [name for name, tensor in _tensors(model).items() if tensor.is_meta]
    if left:
        raise CacheMismatch(f"{len(left)} tensor(s) left unloaded ({', '.join(left[:3])})")
