"""A GGUF model loaded tensor by tensor into the int kernel's layout, never as a float model first
(`quantize = "auto"` on a CPU where the kernel runs).

transformers' GGUF loading dequantizes every tensor to float before the model exists: a 7B Q4_K_M
file (4.4 GB) would pass through 28 GB of float32. Here the model's skeleton is built on the meta
device from the file's config, and each tensor is read from the file on its own (plain reads at its
offset: no mapping that would keep the file's pages resident) and goes straight to what serves it:

- a linear layer's weight of a type the kernel runs (runtime.model.gguf_blocks.SUPPORTED) becomes an
  int layer holding the file's codes and scales (`Int4Linear.from_blocks`), its rows in the order
  transformers' tensor processor puts them (llama's q/k; Qwen3.5's value heads, runtime.model.gguf_qwen35,
  whose `ssm_out` keeps its columns in the file's order and gathers its input into it);
- a linear layer's F32, F16 or BF16 weight runs in ponder's float kernel (runtime.model.float_layers)
  in the file's own type, so an F16 file is served in the memory it takes, not widened to float32;
- a routed block's stacked expert tensors become one kernel layer an expert, an expert's slab of
  blocks at a time (runtime.model.gguf_experts; gpt-oss's, with their biases, runtime.model.gguf_gpt_oss);
- a quantized token embedding keeps its blocks, its rows dequantized on lookup
  (runtime.model.block_embedding): the file's bytes as they are, or, where the head is tied to it and
  of a type the kernel runs, the head's int layer made of those blocks, from which it reads its rows;
- every other tensor (norms, a float embedding, a linear weight of another type) is dequantized by
  `gguf.dequantize` and passed through the same processor, as transformers loads it.

On a GPU (`device`, runtime.model.cached_model decides) a supported linear weight becomes a
`GpuBlockLinear` on the device instead (runtime.model.gpu_blocks: the file's codes and scales for the
Triton block GEMM, decoded a slab of rows at a time on the host), routed experts' blocks are stacked
there an expert a slice for the routed Triton kernels (runtime.model.gpu_experts; experts of another
type refuse the path), and the rest as above: the embedding and F16/BF16/F32 linear weights as the
model's floats, nothing in the CPU kernels' layers.

Peak memory is the served model plus one tensor in flight. Strict as runtime.model.loader's loading:
every parameter must come from the file (`CheckpointMismatch` otherwise); non-persistent buffers
(rotary tables) are computed by the model's own initializer, as transformers does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from runtime.kernels.cpu_kernels import KernelUnavailable, float_kernel
from runtime.model.block_embedding import SCALED, BlockEmbedding, HeadRowsEmbedding, row_scale
from runtime.model.float_layers import FloatLinear
from runtime.model.gguf_blocks import SUPPORTED, decode, describe_kinds, open_gguf, row_order
from runtime.model.gguf_experts import expert_tensors
from runtime.model.gguf_qwen35 import InputOrder
from runtime.model.gpu_blocks import GpuBlockLinear, gpu_block_layer
from runtime.model.loader import CheckpointMismatch, ModelSource
from runtime.model.quantize import Int4Linear, Quantized, blocks_detail

# A GGUF's float tensor types ponder's float kernel computes with as they are.
FLOAT_KINDS = ("F32", "F16", "BF16")


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


@functools.cache
def _fix_mmap_threshold() -> None:
    """Keep glibc's threshold for allocating with mmap at its default 128 KiB instead of letting it grow
    to the largest block freed so far: otherwise, once a slab's buffers are freed, the next ones come
    from the heap, whose freed middle is never given back, and a load keeps about a fifth more than it
    serves. Nothing happens where the C library is not glibc."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True)
class _Tensor:
    """Where a tensor is in the file and how gguf's reader shapes its bytes."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple
    data_offset: int
    data_shape: tuple
    data_dtype: np.dtype


def _read(file, tensor: _Tensor, start: int = 0, stop: int | None = None) -> np.ndarray:
    """The tensor's bytes as gguf's reader shapes them (rows `start` to `stop` only, if given), read
    from the file (not from its mapping)."""
    rows = tensor.data_shape[0] if stop is None else stop - start
    raw = np.empty((rows, *tensor.data_shape[1:]), tensor.data_dtype)
    row_bytes = raw[:1].nbytes if len(tensor.data_shape) > 1 else raw.itemsize
    file.seek(tensor.data_offset + start * row_bytes)
    if file.readinto(memoryview(raw.reshape(-1).view(np.uint8))) != raw.nbytes:
        raise CheckpointMismatch(f"{tensor.name} is cut short in the file")
    return raw


_SLAB_WEIGHTS = 1 << 20  # weights decoded and packed at a time (in rows of a multiple of the kernel's 8 columns)


def _int_layer(kind: str, rows: Callable[[int, int], np.ndarray], shape: tuple[int, int]) -> Int4Linear:
    """An int layer of the [out, bytes] blocks `rows(start, stop)` gives, decoded and packed a slab of
    rows at a time into its buffers (the whole tensor's bytes, codes and their layout's copies would
    otherwise be held at once beside the model loaded so far)."""
    out_features, in_features = shape
    slab_rows = max(8, _SLAB_WEIGHTS // in_features // 8 * 8)
    weight = d = m = None
    for start in range(0, out_features, slab_rows):
        slab = Int4Linear.from_blocks(decode(kind, rows(start, min(start + slab_rows, out_features))))
        if weight is None:
            blocks = -(-out_features // 8)
            weight = slab.weight.new_empty((blocks, *slab.weight.shape[1:]))
            d = slab.d.new_empty((blocks, *slab.d.shape[1:]))
            m = None if slab.m is None else slab.m.new_empty((blocks, *slab.m.shape[1:]))
        first = start // 8
        weight[first:first + slab.weight.shape[0]] = slab.weight
        d[first:first + slab.d.shape[0]] = slab.d
        if m is not None:
            m[first:first + slab.m.shape[0]] = slab.m
    return Int4Linear.from_packed(in_features, out_features, weight, d, m)


def _rows_of(raw: np.ndarray, start: int, stop: int) -> np.ndarray:
    return raw[start:stop]


def _float_weight(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """A float tensor's [out, in] values in the file's own type (gguf's reader gives BF16 as bytes)."""
    if kind == "BF16":
        return torch.from_numpy(np.ascontiguousarray(raw).view(np.int16).reshape(shape)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(raw).reshape(shape))


def _expert_layer(kind: str, raw: np.ndarray, shape: tuple[int, int], device: torch.device | None = None):
    """One expert's layer of a stacked tensor: its blocks, or its floats in ponder's float kernel (a type
    no kernel runs dequantized to float32, an expert at a time). On a GPU (`device`) its blocks there,
    and a type they do not cover refused (CheckpointMismatch: the caller loads through transformers)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if device is not None:
        if kind not in SUPPORTED:
            raise CheckpointMismatch(f"routed experts of type {kind} are not kept on a GPU (its blocks cover "
                                     f"{', '.join(SUPPORTED)})")
        return gpu_block_layer(kind, lambda start, stop: raw[start:stop], shape, device)
    if kind in SUPPORTED:
        return _int_layer(kind, lambda start, stop: raw[start:stop], shape)
    if kind in FLOAT_KINDS:
        return FloatLinear.from_weight(_float_weight(kind, raw, shape))
    return FloatLinear.from_weight(torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(shape)))


def _float_kernel_runs() -> bool:
    try:
        float_kernel()
    except KernelUnavailable:
        return False
    return True


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    parent_name, _, attribute = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = parent._parameters.get(attribute)
    if old is not None and not old.is_meta:
        raise CheckpointMismatch(f"{name} is loaded twice")
    if old is not None and tuple(old.shape) != tuple(value.shape):
        raise CheckpointMismatch(f"{name} is {tuple(value.shape)} in the file, the model wants {tuple(old.shape)}")
    parent._parameters[attribute] = nn.Parameter(value.to(old.dtype if old is not None else value.dtype),
                                                 requires_grad=False)


def _is_blocks(tensor) -> bool:
    """Whether the tensor is quantized (blocks of several values), not plain floats or integers."""
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[tensor.tensor_type][0] > 1


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attribute, module)


def _skeleton(config, dtype: torch.dtype, attn_implementation: str, trust_remote_code: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation,
                                                trust_remote_code=trust_remote_code)


def _initialize_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (rotary tables) computed by the model's own initializer on the CPU."""
    for module in model.modules():
        meta = [name for name, buffer in module._buffers.items() if buffer is not None and buffer.is_meta]
        for name in meta:
            module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
        if meta:
            model._init_weights(module)


@torch.no_grad()
def load_gguf_blocks(source: ModelSource, config, dtype: torch.dtype, attn_implementation: str,
                     trust_remote_code: bool = False, device: torch.device | None = None) -> tuple[nn.Module, Quantized]:
    """The model in `source`'s GGUF with every linear layer of a supported type as an int layer, or with
    `device` (a GPU's path: runtime.model.gpu_blocks), as a `GpuBlockLinear` on `device`, every other
    tensor dequantized into the model's float weights there (the embedding too), routed experts kept in
    their blocks there too (runtime.model.gpu_experts; a type the blocks do not cover raises
    CheckpointMismatch, so the caller loads through transformers)."""
    from gguf.quants import dequantize
    _fix_mmap_threshold()
    model = _skeleton(config, dtype, attn_implementation, trust_remote_code)
    reader, processor, names = open_gguf(model, source.path)
    # The reader parses every metadata field into arrays (128 MB for SmolLM2's 49152 tokens): only the
    # tensors' places are kept while they load.
    tensors = [_Tensor(t.name, t.tensor_type, tuple(t.shape), t.data_offset, t.data.shape, t.data.dtype)
               for t in reader.tensors]
    del reader
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()
    tied = getattr(model.config, "tie_word_embeddings", False) and isinstance(head, nn.Linear)
    embedding = model.get_input_embeddings()
    embed_name = next(n for n, m in modules.items() if m is embedding)
    # (a subclass that does more than look rows up, or scale them as Gemma's do, keeps its float rows; a
    # GPU's embedding is float: the block lookup is the CPU's)
    keeps_blocks = (type(embedding) is nn.Embedding or type(embedding).__name__ in SCALED) and device is None
    scale = row_scale(embedding)
    head_name = next((n for n, m in modules.items() if m is head), None)
    kinds: dict[str, int] = {}
    kept: dict[str, int] = {}
    in_float_kernel: dict[str, int] = {}
    floats = 0
    float_kernel_runs = device is None and _float_kernel_runs()
    biases: dict[str, torch.Tensor] = {}
    experts = expert_tensors(model, device)  # routed experts' stacked tensors, one kernel layer an expert
    with open(source.path, "rb") as file:
        for tensor in tensors:
            target = names.get(tensor.name)
            # (transformers' map names a stacked experts tensor without its `.weight`)
            block = experts.owner(tensor.name, target or names.get(tensor.name.removesuffix(".weight"), ""))
            if block is None and target is None:
                continue  # as transformers: a tensor no parameter maps to is not read
            if block is not None and tensor.name.endswith(".bias"):  # (gpt-oss's experts' biases)
                experts.take_bias(block, tensor.name, dequantize(_read(file, tensor), tensor.tensor_type))
                continue
            if block is not None:
                kind = tensor.tensor_type.name
                kinds[kind] = kinds.get(kind, 0) + 1
                experts.take(block, tensor.name, _read(file, tensor), lambda raw, shape: _expert_layer(kind, raw, shape, device))
                if kind in SUPPORTED or kind in FLOAT_KINDS:  # (a stacked tensor counted as one layer)
                    counts = kept if kind in SUPPORTED else in_float_kernel
                    counts[kind] = counts.get(kind, 0) + 1
                else:
                    floats += 1
                continue
            module_name, _, suffix = target.rpartition(".")
            module = modules.get(module_name)
            kind = tensor.tensor_type.name
            is_linear = isinstance(module, nn.Linear) and suffix == "weight"
            stands_for_head = tied and module is embedding and suffix == "weight"
            if is_linear or stands_for_head:
                kinds[kind] = kinds.get(kind, 0) + 1
            raw = None  # read when it is known how: a slab of rows at a time into an int layer
            shape = tuple(int(n) for n in reversed(tensor.shape))
            as_float = kind in FLOAT_KINDS and float_kernel_runs and len(shape) == 2 and shape[1] % 16 == 0
            if (is_linear or stands_for_head) and (kind in SUPPORTED or as_float):
                layer_name = head_name if stands_for_head else module_name
                layer = modules[layer_name]
                if shape != (layer.out_features, layer.in_features):
                    raise CheckpointMismatch(f"{source.path}: {tensor.name} is {shape}, "
                                             f"{layer_name} wants {(layer.out_features, layer.in_features)}")
                order = row_order(processor, tensor.name, shape[0], names).numpy()
                in_order = np.array_equal(order, np.arange(shape[0]))
                parent_name, _, attribute = layer_name.rpartition(".")
                if kind in SUPPORTED:
                    rows = functools.partial(_read, file, tensor) if in_order else \
                        functools.partial(_rows_of, _read(file, tensor)[order])
                    served = _int_layer(kind, rows, shape) if device is None else gpu_block_layer(kind, rows, shape, device)
                    kept[kind] = kept.get(kind, 0) + 1
                else:
                    raw = _read(file, tensor) if in_order else _read(file, tensor)[order]
                    served = FloatLinear.from_weight(_float_weight(kind, raw, shape))
                    in_float_kernel[kind] = in_float_kernel.get(kind, 0) + 1
                stored_order = getattr(processor, "input_order", lambda name: None)(tensor.name)
                if stored_order is not None:  # columns stored in another order: kept so, the input gathered
                    served = InputOrder(served, stored_order)
                setattr(model.get_submodule(parent_name), attribute, served)
                if is_linear:
                    continue
                if kind in SUPPORTED and keeps_blocks:  # the embedding reads its rows from the head's blocks
                    _replace(model, embed_name, HeadRowsEmbedding(served, dtype, scale))
                    continue
                # (else the embedding standing for the head goes on to its float rows below)
            elif is_linear or stands_for_head:
                floats += 1
            elif module is embedding and suffix == "weight" and _is_blocks(tensor) and keeps_blocks:
                if shape != (embedding.num_embeddings, embedding.embedding_dim):
                    raise CheckpointMismatch(f"{source.path}: {tensor.name} is {shape}, {embed_name} wants "
                                             f"{(embedding.num_embeddings, embedding.embedding_dim)}")
                _replace(model, embed_name, BlockEmbedding(kind, torch.from_numpy(_read(file, tensor)), shape[1], dtype,
                                                            scale))
                continue
            raw = _read(file, tensor) if raw is None else raw
            weights = processor.process(weights=dequantize(raw, tensor.tensor_type), name=tensor.name,
                                        tensor_key_mapping=names, parsed_parameters={}).weights
            value = torch.from_numpy(np.ascontiguousarray(weights))
            if suffix == "bias" and isinstance(module, nn.Linear):
                biases[module_name] = value  # the layer may become an int layer later in the file
            else:
                _set_tensor(model, target, value)
    experts.finish()
    for name, bias in biases.items():
        layer = model.get_submodule(name)
        if isinstance(layer, (Int4Linear, FloatLinear, GpuBlockLinear)):
            layer.bias = nn.Parameter(bias.to(device=layer.weight.device, dtype=dtype), requires_grad=False)
        else:
            _set_tensor(model, f"{name}.bias", bias)
    if tied and isinstance(model.get_output_embeddings(), nn.Linear):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    elif tied:
        model.config.tie_word_embeddings = False  # the head is a quantized copy; the embedding keeps its weights
    _initialize_buffers(model)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointMismatch(f"{source.path}: {len(left)} model parameter(s) missing from the checkpoint "
                                 f"({', '.join(left[:3])}); ponder serves no weight left at random")
    found = describe_kinds(kinds)
    if device is not None:
        model.to(device)  # (the blocks' layers are there already; no dtype: their scales stay float32)
        if not kept:
            return model.eval(), Quantized("auto", "none", 0, f"no linear layers of a type the blocks cover in the GGUF; {found}")
        return model.eval(), Quantized("auto", "gpu_blocks", sum(kept.values()), blocks_detail(kept, floats, found),
                                       tuple(sorted(kept)))
    if not kept and not in_float_kernel:
        return model.eval(), Quantized("auto", "none", 0,
                                       f"no linear layers of a type the int kernel runs in the GGUF; {found}")
    mode = "int4" if kept else "float"
    return model.eval(), Quantized("auto", mode, sum(kept.values()) + sum(in_float_kernel.values()),
                                   blocks_detail(kept, floats, found, in_float_kernel),
                                   tuple(sorted({*kept, *in_float_kernel})))
