"""A GGUF file's own 4-bit blocks, read back as codes, scales and zero points (`quantize = "auto"`).

A Q4_1 block holds 32 weights as w = d * q + m (q in 0..15, d and m float16), a Q4_0 block as
w = d * (q - 8). Both are exactly group-wise int4 with groups of 32 input features: the layers built
from these codes compute with the very weights the file stores, instead of quantizing transformers'
dequantized floats a second time.

Tensors are matched to the model's linear layers with transformers' own GGUF name map and tensor
processor (which reorders the rows of some tensors, e.g. llama's q/k projections), and every layer's
codes are checked to dequantize to exactly the weights transformers loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

GROUP_SIZE = 32


@dataclass
class Q4Blocks:
    """One tensor's blocks: `dequantized()` is what gguf (and so transformers) computes from the file."""

    kind: str  # "Q4_0" or "Q4_1"
    codes: torch.Tensor  # [out, in] uint8, 0..15
    d: torch.Tensor  # [out, in / 32] float32 (exact float16 values)
    m: torch.Tensor | None  # [out, in / 32] float32 for Q4_1, None for Q4_0

    def dequantized(self) -> torch.Tensor:
        groups = self.codes.reshape(*self.d.shape, GROUP_SIZE).float()
        if self.m is None:
            w = (groups - 8) * self.d[..., None]
        else:
            w = self.d[..., None] * groups + self.m[..., None]
        return w.reshape(self.codes.shape)

    def d_and_m(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, m) per group for w = d * q + m; Q4_0's d * (q - 8) has m = -8d (exact in float16)."""
        return self.d, -8 * self.d if self.m is None else self.m


def decode_q4(kind: str, data: np.ndarray) -> Q4Blocks:
    """The blocks of a `[rows, bytes]` uint8 array of Q4_0 or Q4_1 data."""
    head = 2 if kind == "Q4_0" else 4  # float16 d (and m) before the 16 bytes of codes
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, head + GROUP_SIZE // 2)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else None
    packed = blocks[..., head:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)  # low nibbles first
    return Q4Blocks(kind, torch.from_numpy(codes), torch.from_numpy(d),
                    None if m is None else torch.from_numpy(m))


def linear_blocks(model: nn.Module, path: str) -> tuple[dict[str, Q4Blocks], str]:
    """The 4-bit blocks of `model`'s linear layers loaded from the GGUF at `path`, by module name, and
    a phrase saying what the file holds. Layers stored otherwise (e.g. a Q8_0 or float head) are
    absent. Raises ValueError where a layer's codes do not give the weights transformers loaded."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map)

    reader = GGUFReader(path)
    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()
    tied = getattr(model.config, "tie_word_embeddings", False) and isinstance(head, nn.Linear)
    embedding = model.get_input_embeddings() if tied else None  # then it stands for the head too
    found: dict[str, Q4Blocks] = {}
    kinds: dict[str, int] = {}
    for tensor in reader.tensors:
        target = names.get(tensor.name, "")
        module = modules.get(target.removesuffix(".weight")) if target.endswith(".weight") else None
        if not isinstance(module, nn.Linear) and (module is None or module is not embedding):
            continue
        kind = tensor.tensor_type.name
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind not in ("Q4_0", "Q4_1"):
            continue
        blocks = decode_q4(kind, tensor.data)
        # The processor may reorder rows (llama's q/k): apply its order to the row indices.
        rows = blocks.codes.shape[0]
        order = processor.process(weights=np.arange(rows).reshape(rows, 1), name=tensor.name,
                                  tensor_key_mapping=names, parsed_parameters={}).weights.reshape(-1)
        order = torch.from_numpy(np.ascontiguousarray(order)).long()
        blocks = Q4Blocks(kind, blocks.codes[order], blocks.d[order], None if blocks.m is None else blocks.m[order])
        name = target.removesuffix(".weight")
        if not torch.equal(blocks.dequantized().to(module.weight.dtype), module.weight.detach().cpu()):
            raise ValueError(f"the {kind} blocks of {tensor.name} do not give the weights loaded into {name}")
        found[name] = blocks
    if embedding is not None:  # a tied head has no tensor of its own: it is the embedding's
        embed_name = next(n for n, m in modules.items() if m is embedding)
        head_name = next(n for n, m in modules.items() if m is head)
        if embed_name in found:
            found[head_name] = found.pop(embed_name)
    summary = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
    return found, f"linear tensors in the file: {summary or 'none'}"
