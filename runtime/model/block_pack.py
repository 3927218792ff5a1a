"""The int kernel's weight layout (runtime/kernels/csrc/q4_tile.h and block_tile.h): output columns in
blocks of 8 that the kernel computes side by side, a column a vector lane, the last block padded with
zero columns.

- 4-bit codes: a block's group of 32 inputs as 4 chunks of 32 bytes, where column j's 4 bytes hold
  codes 8c + t (low nibble) and 8c + 4 + t (high nibble) of chunk c: codes [blocks, 4 * in] bytes.
- 5-bit codes: the low 4 bits so, then 32 bytes a group whose column j's uint32 holds the fifth bits,
  bit 8t + 2c + h that of code 8c + 4h + t: [blocks, 5 * in].
- 8-bit codes (signed): chunk c's 64 bytes give column j 4 bytes of codes 8c + t in the first 32 and
  of codes 8c + 4 + t in the second 32: [blocks, 8 * in].
- d and m: [blocks, in / 32 (or in / 16), 8], float16 or float32; or a K-quant's own form,
  [blocks, in / 256, 16 + 8 * n] bytes: a super-block's 8 float16 scales, then its n sub-scales x 8
  columns as int8 (a scale is their product, exact in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUP_SIZE = 32  # the kernel's activation group, a GGUF block
BLOCK_COLUMNS = 8  # output columns the kernel computes side by side


def _blocks(out_features: int) -> tuple[int, int]:
    blocks = -(-out_features // BLOCK_COLUMNS)
    return blocks, blocks * BLOCK_COLUMNS - out_features


def _lanes(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] as [blocks, column, group, chunk, half, byte] (padded with zero columns)."""
    out_features, in_features = codes.shape
    blocks, pad = _blocks(out_features)
    c = F.pad(codes, (0, 0, 0, pad))
    return c.reshape(blocks, BLOCK_COLUMNS, in_features // GROUP_SIZE, 4, 2, 4)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """The low 4 bits of `codes` [out, in] in the 4-bit layout: [blocks, 4 * in] uint8."""
    c = _lanes((codes.to(torch.uint8) & 0x0F)).permute(0, 2, 3, 1, 4, 5)  # block, group, chunk, lane, half, byte
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(c.shape[0], -1).contiguous()


def pack_fifth_bits(codes: torch.Tensor) -> torch.Tensor:
    """Bit 4 of `codes` [out, in]: [blocks, groups, 32] bytes, column j's 4 bytes a group."""
    c = _lanes((codes.to(torch.uint8) >> 4) & 1).permute(0, 2, 1, 5, 3, 4)  # block, group, lane, byte t, chunk, half
    weights = (1 << torch.arange(8, dtype=torch.uint8)).reshape(4, 2)
    return (c * weights).sum(dim=(-2, -1), dtype=torch.uint8).reshape(c.shape[0], c.shape[1], 32)


def pack_scales(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """d or m [out, groups] as [blocks, groups, 8] of `dtype`."""
    blocks, pad = _blocks(v.shape[0])
    v = F.pad(v.to(dtype), (0, 0, 0, pad))
    return v.reshape(blocks, BLOCK_COLUMNS, v.shape[1]).permute(0, 2, 1).contiguous()


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`codes` [out, in] (uint8 for 4 and 5 bits, int8 for 8) in the kernel's layout for `bits`."""
    if bits == 4:
        return pack_nibbles(codes)
    if bits == 5:
        nibbles = pack_nibbles(codes)
        groups = codes.shape[1] // GROUP_SIZE
        high = pack_fifth_bits(codes)
        return torch.cat([nibbles.reshape(nibbles.shape[0], groups, 128), high], dim=-1).reshape(nibbles.shape[0], -1)
    if bits == 8:
        c = _lanes(codes.to(torch.int8).view(torch.uint8)).permute(0, 2, 3, 4, 1, 5)  # block, group, chunk, half, lane, byte
        return c.reshape(c.shape[0], -1).contiguous()
    raise ValueError(f"no kernel layout for {bits}-bit codes")


def unpack_codes(packed: torch.Tensor, bits: int, out_features: int, in_features: int) -> torch.Tensor:
    """`pack_codes`' inverse: [out, in] codes (int8 for 8 bits, else uint8)."""
    blocks, groups = packed.shape[0], in_features // GROUP_SIZE
    if bits == 8:
        c = packed.reshape(blocks, groups, 4, 2, BLOCK_COLUMNS, 4).permute(0, 4, 1, 2, 3, 5)
        return c.reshape(-1, in_features)[:out_features].view(torch.int8)
    per_group = packed.reshape(blocks, groups, -1)
    raw = per_group[..., :128].reshape(blocks, groups, 4, BLOCK_COLUMNS, 4)  # block, group, chunk, lane, byte
    codes = torch.stack([raw & 0x0F, raw >> 4], dim=-2)  # block, group, chunk, lane, half, byte
    if bits == 5:
        high = per_group[..., 128:].reshape(blocks, groups, BLOCK_COLUMNS, 4, 1)  # block, group, lane, byte t
        bit = (high >> torch.arange(8, dtype=torch.uint8)) & 1  # ..., t, (chunk, half)
        bit = bit.reshape(blocks, groups, BLOCK_COLUMNS, 4, 4, 2).permute(0, 1, 4, 2, 5, 3)  # block, group, chunk, lane, half, t
        codes = codes | (bit << 4)
    codes = codes.permute(0, 3, 1, 2, 4, 5).reshape(blocks * BLOCK_COLUMNS, in_features)
    return codes[:out_features]


def unpack_scales(v: torch.Tensor, out_features: int) -> torch.Tensor:
    """`pack_scales`' (or `pack_compact`'s) inverse, as float32 [out, groups]."""
    if v.dtype == torch.uint8:
        return unpack_compact(v, out_features)
    return v.permute(0, 2, 1).reshape(-1, v.shape[1])[:out_features].float()


def pack_compact(super_scales: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    """A K-quant's scales, `super_scales` [out, in / 256] (float16 values) and `sub` [out, groups] int8,
    in the kernel's form [blocks, in / 256, 16 + 8 * n] uint8."""
    blocks, pad = _blocks(super_scales.shape[0])
    supers = super_scales.shape[1]
    head = pack_scales(super_scales, torch.float16).view(torch.uint8)  # blocks, supers, 16
    s = F.pad(sub.to(torch.int8), (0, 0, 0, pad)).reshape(blocks, BLOCK_COLUMNS, supers, -1)
    tail = s.permute(0, 2, 3, 1).reshape(blocks, supers, -1).view(torch.uint8)
    return torch.cat([head, tail], dim=-1).contiguous()


def unpack_compact(v: torch.Tensor, out_features: int) -> torch.Tensor:
    """`pack_compact`'s scales as their products, float32 [out, groups]."""
    blocks, supers = v.shape[0], v.shape[1]
    head = v[..., :16].contiguous().view(torch.float16).float()  # blocks, supers, 8
    sub = v[..., 16:].contiguous().view(torch.int8).reshape(blocks, supers, -1, BLOCK_COLUMNS).float()
    products = head[:, :, None, :] * sub  # blocks, supers, n, column
    return products.permute(0, 3, 1, 2).reshape(blocks * BLOCK_COLUMNS, -1)[:out_features]
