"""A GGUF file's own quantized blocks, read back as integer codes and per-group scales (`quantize = "auto"`).

Every type the int kernel runs is exactly w = d * q + m over groups of 32 input features (of 16 for
Q2_K, Q3_K and Q6_K, the last two without m), with integer codes q:

| type | codes q | d, m per group | bits a weight in the file |
|---|---|---|---|
| Q4_0 | 0..15 | d, m = -8 d (float16) | 4.5 |
| Q4_1 | 0..15 | d, m (float16) | 5 |
| Q5_0 | 0..31 | d, m = -16 d (float16) | 5.5 |
| Q5_1 | 0..31 | d, m (float16) | 6 |
| Q8_0 | -128..127 | d (float16) | 8.5 |
| Q4_K | 0..15 | d * scale, -dmin * min (float32: the 6-bit scale and min times the super-block's float16) | 4.5 |
| Q5_K | 0..31 | as Q4_K | 5.5 |
| Q2_K | 0..3 | d * scale, -dmin * min per 16 (float32: the 4-bit scale and min times the super-block's float16) | 2.63 |
| Q3_K | -4..3 | d * (scale - 32) per 16 (float32: the 6-bit scale times the super-block's float16) | 3.44 |
| Q6_K | -32..31 | d * scale per 16 (float32) | 6.56 |
| IQ4_NL | 16 values in -127..113 | d (float16) | 4.5 |
| IQ4_XS | as IQ4_NL | d * (scale - 32) (float32) | 4.25 |
| MXFP4 | 16 values in -12..12 (E2M1 doubled) | d: the E8M0 byte's power of two, halved (float32) | 4.25 |

The layers built from these codes compute with the very weights the file stores (`dequantized()` is
what `gguf.dequantize` computes, tested type by type) instead of quantizing dequantized floats again.
`decode` reads one tensor's raw bytes; `linear_blocks` matches a loaded float model's linear layers to
the file's tensors (the start-up path that never makes floats is runtime.model.gguf_load).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

GROUP_SIZE = 32
SUPPORTED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
             "MXFP4")
_PRODUCT_SCALES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
# types whose d needs float32: products of two scales, or MXFP4's powers of two (2^-128 to 2^127)
_FLOAT32_SCALES = (*_PRODUCT_SCALES, "MXFP4")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210,
                "IQ4_NL": 18, "IQ4_XS": 136, "MXFP4": 17}
# The 16 values an IQ4 code stands for (ggml's kvalues_iq4nl).
_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
# The 16 values an MXFP4 code stands for: E2M1's {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives, doubled
# to integers (ggml's kvalues_mxfp4), its scale halved to match.
_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


@dataclass
class Blocks:
    """One tensor's blocks: `dequantized()` is what gguf (and so transformers) computes from the file."""

    kind: str
    codes: torch.Tensor  # [out, in] uint8 (0..15 or 0..31) or int8 (Q8_0, Q3_K, Q6_K, the IQ4 types)
    d: torch.Tensor  # [out, in / 32] float32 ([out, in / 16] for Q2_K, Q3_K and Q6_K)
    m: torch.Tensor | None  # as d, or None
    # A K-quant's scales as the file holds them: (super-block d [out, in / 256] float32 of float16 values,
    # sub-scales [out, groups] int8, and the same for m (sub-scales negated) or None), d and m their products.
    compact: tuple | None = None

    @property
    def bits(self) -> int:
        """The kernel's code width: 4, 5 or 8 bits."""
        return 8 if self.codes.dtype == torch.int8 else 5 if self.kind.startswith("Q5") else 4

    @property
    def float_scales(self) -> bool:
        """Whether d and m need float32 (a K-quant's scale times its super-block's scale, MXFP4's power of
        two) or fit float16."""
        return self.kind in _FLOAT32_SCALES

    def dequantized(self) -> torch.Tensor:
        size = self.codes.shape[1] // self.d.shape[1]
        groups = self.codes.reshape(*self.d.shape, size).float()
        w = self.d[..., None] * groups
        if self.m is not None:
            w = w + self.m[..., None]
        return w.reshape(self.codes.shape)

    def rows(self, order: torch.Tensor) -> "Blocks":
        compact = None if self.compact is None else tuple(None if t is None else t[order] for t in self.compact)
        return Blocks(self.kind, self.codes[order], self.d[order], None if self.m is None else self.m[order], compact)


def _half(raw: np.ndarray) -> np.ndarray:
    """float16 values from [..., 2] bytes, as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """ggml's 4-bit layout: byte j holds code j (low nibble) and code j + 16 (high nibble)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit i of the little-endian bytes `qh` [..., count / 8] as [..., count] 0/1."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[..., :count]


def mxfp4_scale(e: np.ndarray) -> np.ndarray:
    """2^(e - 128) as float32 for E8M0 bytes `e`, exactly (e 0 and 1 give subnormals)."""
    bits = np.where(e < 2, np.uint32(0x00200000) << e.astype(np.uint32), (e.astype(np.uint32) - 1) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K super-block from its 12 bytes (ggml's get_scale_min_k4)."""
    q = scales.astype(np.uint8)
    sc = np.empty((*q.shape[:-1], 8), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = q[..., 0:4] & 63, q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def decode(kind: str, data: np.ndarray) -> Blocks:
    """The blocks of a `[rows, bytes]` uint8 array of `kind` data (one of SUPPORTED)."""
    if kind not in SUPPORTED:
        raise ValueError(f"no int kernel for {kind}")
    rows = data.shape[0]
    b = np.ascontiguousarray(data).reshape(rows, -1, _BLOCK_BYTES[kind])
    m = compact = None
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        head = 4 if kind.endswith("_1") else 2
        d = _half(b[..., 0:2])
        high = None
        if kind.startswith("Q5"):
            high = _bits(b[..., head:head + 4], 32)
            head += 4
        codes = _nibbles(b[..., head:])
        if high is not None:
            codes = codes | (high << 4)
        m = _half(b[..., 2:4]) if kind.endswith("_1") else d * -(8 if kind == "Q4_0" else 16)
    elif kind == "IQ4_NL":
        d = _half(b[..., 0:2])
        codes = _IQ4_VALUES[_nibbles(b[..., 2:])]
    elif kind == "MXFP4":  # e (an E8M0 exponent), qs[16]: d = 2^(e - 128), ggml's GGML_E8M0_TO_FP32_HALF
        d = mxfp4_scale(b[..., 0])
        codes = _MXFP4_VALUES[_nibbles(b[..., 1:])]
    elif kind == "IQ4_XS":  # d, scales_h (uint16), scales_l[4], qs[128]: 8 groups of 32 with 6-bit scales - 32
        dd = _half(b[..., 0:2])
        high = b[..., 2:4].copy().view(np.uint16)[..., 0:1] >> (2 * np.arange(8, dtype=np.uint16)) & 3
        low = (b[..., 4:8, None] >> np.array([0, 4], np.uint8)) & 0x0F
        sub = (low.reshape(rows, -1, 8) | (high << 4)).astype(np.int8) - 32
        d = (dd[..., None] * sub.astype(np.float32)).reshape(rows, -1)
        compact = (dd, sub.reshape(rows, -1), None, None)
        codes = _IQ4_VALUES[_nibbles(b[..., 8:].reshape(rows, -1, 8, 16))]
    elif kind == "Q8_0":
        d = _half(b[..., 0:2])
        codes = b[..., 2:].view(np.int8)
    elif kind in ("Q4_K", "Q5_K"):
        dd, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        d = (dd[..., None] * sc).reshape(rows, -1)
        m = -(dmin[..., None] * mn).reshape(rows, -1)
        compact = (dd, sc.astype(np.int8).reshape(rows, -1), dmin, (-mn).astype(np.int8).reshape(rows, -1))
        qs = b[..., -128:].reshape(rows, -1, 4, 32)  # 4 chunks of 32 bytes, each two groups (low then high nibbles)
        codes = np.stack([qs & 0x0F, qs >> 4], axis=-2)  # super-block, chunk, nibble, 32
        if kind == "Q5_K":
            high = _bits(b[..., 16:48].reshape(rows, -1, 32, 1), 8)  # super-block, byte l, group g
            codes = codes | (np.moveaxis(high, -1, -2).reshape(rows, -1, 4, 2, 32) << 4)
    elif kind == "Q2_K":  # 16 bytes of a 4-bit scale and min per 16, qs[64], d, dmin
        dd, dmin = _half(b[..., 80:82]), _half(b[..., 82:84])
        sc, mn = (b[..., 0:16] & 0x0F).astype(np.int8), (b[..., 0:16] >> 4).astype(np.int8)
        d = (dd[..., None] * sc.astype(np.float32)).reshape(rows, -1)
        m = -(dmin[..., None] * mn.astype(np.float32)).reshape(rows, -1)
        compact = (dd, sc.reshape(rows, -1), dmin, (-mn).reshape(rows, -1))
        # weight 32 j + l (j = 4 half + shift): the 2 bits of qs byte 32 half + l at `shift`
        codes = (b[..., 16:80].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    elif kind == "Q3_K":  # hmask[32], qs[64], 16 6-bit scales in 12 bytes, d: a weight is d * (scale - 32) * q
        dd = _half(b[..., 108:110])
        low = (b[..., None, 96:104] >> np.array([0, 4], np.uint8)[:, None]) & 0x0F  # nibble, byte: scales 0-15's low 4 bits
        high = (b[..., None, 104:108] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3  # pair, byte: their top 2 bits
        sub = (low.reshape(rows, -1, 16) | (high.reshape(rows, -1, 16) << 4)).astype(np.int8) - np.int8(32)
        d = (dd[..., None] * sub.astype(np.float32)).reshape(rows, -1)
        compact = (dd, sub.reshape(rows, -1), None, None)
        # weight 32 j + l (j = 4 half + shift): 2 low bits of qs byte 32 half + l at `shift`, and q - 4
        # where bit j of hmask byte l is clear
        low_bits = (b[..., 32:96].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        high_bit = (b[..., None, 0:32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
        codes = low_bits.reshape(rows, -1, 8, 32).astype(np.int8) - ((1 - high_bit) << 2).astype(np.int8)
    else:  # Q6_K: ql[128], qh[64], 16 int8 scales, d
        dd = _half(b[..., 208:210])
        sc = b[..., 192:208].view(np.int8)
        d = (dd[..., None] * sc.astype(np.float32)).reshape(rows, -1)
        compact = (dd, sc.reshape(rows, -1), None, None)
        ql = b[..., 0:128].reshape(rows, -1, 2, 2, 32)  # half, quarter, 32
        qh = b[..., 128:192].reshape(rows, -1, 2, 32)
        low = np.stack([ql & 0x0F, ql >> 4], axis=-3)  # half, nibble, quarter, 32: weights 64 nibble + 32 quarter
        shifts = np.array([0, 2, 4, 6], np.uint8).reshape(2, 2, 1)  # nibble, quarter
        high = (qh[..., None, None, :] >> shifts) & 3
        codes = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    def tensor(a):
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a).reshape(rows, -1))

    return Blocks(kind, tensor(codes), tensor(d), tensor(m), None if compact is None else tuple(map(tensor, compact)))


def row_order(processor, name: str, rows: int, names: dict[str, str]) -> torch.Tensor:
    """The order transformers' tensor processor puts a tensor's rows in (it reorders some, e.g.
    llama's q/k projections): its result on the row indices."""
    order = processor.process(weights=np.arange(rows).reshape(rows, 1), name=name,
                              tensor_key_mapping=names, parsed_parameters={}).weights.reshape(-1)
    return torch.from_numpy(np.ascontiguousarray(order)).long()


def describe_kinds(kinds: dict[str, int]) -> str:
    summary = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
    return f"linear tensors in the file: {summary or 'none'}"


def open_gguf(model: nn.Module, path: str):
    """(the file's reader, transformers' tensor processor for its architecture, and the map from the
    model's parameter names to the file's tensor names), as transformers' own GGUF loading has them."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map)

    from runtime.model import gguf_gpt_oss
    from runtime.model.gguf_qwen35 import ARCHITECTURES, Qwen35Tensors

    reader = GGUFReader(path)
    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode()
    if architecture == gguf_gpt_oss.ARCHITECTURE:  # (the converter's names for its experts and sinks)
        processor = gguf_gpt_oss.GptOssTensors(config=model.config.to_dict())
        return reader, processor, gguf_gpt_oss.tensor_names(model, processor)
    if architecture in ARCHITECTURES:  # (transformers has no GGUF mapping for Qwen3.5: gguf's name map, ponder's processor)
        processor = Qwen35Tensors(config=model.config.to_dict())
        return reader, processor, get_gguf_hf_weights_map(model, processor, model_type=architecture)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    return reader, processor, get_gguf_hf_weights_map(model, processor)


def linear_blocks(model: nn.Module, path: str) -> tuple[dict[str, Blocks], str]:
    """The quantized blocks of a loaded float `model`'s linear layers from the GGUF at `path`, by
    module name, and a phrase saying what the file holds. Layers of a type the kernel does not run
    (e.g. float) are absent. Raises ValueError where a layer's codes do not give the weights
    transformers loaded."""
    reader, processor, names = open_gguf(model, path)
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()
    tied = getattr(model.config, "tie_word_embeddings", False) and isinstance(head, nn.Linear)
    embedding = model.get_input_embeddings() if tied else None  # then it stands for the head too
    found: dict[str, Blocks] = {}
    kinds: dict[str, int] = {}
    for tensor in reader.tensors:
        target = names.get(tensor.name, "")
        module = modules.get(target.removesuffix(".weight")) if target.endswith(".weight") else None
        if not isinstance(module, nn.Linear) and (module is None or module is not embedding):
            continue
        kind = tensor.tensor_type.name
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind not in SUPPORTED:
            continue
        blocks = decode(kind, tensor.data)
        blocks = blocks.rows(row_order(processor, tensor.name, blocks.codes.shape[0], names))
        name = target.removesuffix(".weight")
        if not torch.equal(blocks.dequantized().to(module.weight.dtype), module.weight.detach().cpu()):
            raise ValueError(f"the {kind} blocks of {tensor.name} do not give the weights loaded into {name}")
        found[name] = blocks
    if embedding is not None:  # a tied head has no tensor of its own: it is the embedding's
        embed_name = next(n for n, m in modules.items() if m is embedding)
        head_name = next(n for n, m in modules.items() if m is head)
        if embed_name in found:
            found[head_name] = found.pop(embed_name)
    return found, describe_kinds(kinds)
