"""A linear layer as a Triton GEMM with a fixed reduction order, over float weights or over a GGUF's own
blocks as runtime.model.gguf_blocks keeps them (w = d * q + m per group of input features).

Each program of `_linear` computes `BLOCK_N` outputs of one row (a GEMV: decode steps have few rows),
summing over the input features in chunks of `BLOCK_K` in order (a packed chunk's bytes loaded once
each, its groups' scales once a group), with sizes that never depend on the number of rows: a row's
outputs are the same bits whatever the other rows (batch invariance by construction, as the CPU
kernels are). A tile may split the inputs among `SPLITS` programs (split-K: their float32 sums added up
in order by a second kernel), which the shape alone decides too.
The weights are dequantized in registers from the file's codes and scales (no re-quantization; what
`gguf.dequantize` computes, tested), and the products summed in float32 on the CUDA cores. A K-quant's
scales may come as the file holds them, an int8 sub-scale a group times a float32 super-block scale
(`supers`), multiplied in registers to the same float32 products (0.75 bits a weight, not 2).

Measured on an H200 (bench/results/gpu-nvidia-h200.json, `linear_sweep`, scales then float32 products):
one row reads the 4-bit blocks at 0.4-1.9 TB/s for an 8B's layers by shape and 2.4 TB/s for its head; sixteen
rows re-read them per row (about 150 GB/s of blocks). A first multi-row tile, dequantizing once for four to
sixteen rows and summing a 3-D product (bench/results/gpu-nvidia-h200-multirow.json), kept every row's bits
but ran 2-5x slower at one row and gained under 2x at sixteen: removed.

`_tile_linear` is the tensor-core tile those sixteen rows want: a program holds a fixed tile of
`BLOCK_M` rows (a row count padded to whole tiles, the padding zeros) and reads each weight once for
them all; a group's codes, small integers, multiply the rows in one `tl.dot` (bfloat16 or float16
operands on a GPU, every product exact), and the group's sums are scaled in float32, d * sum(x q) +
m * sum(x), a group at a time in order. The tile's shape and instructions never depend on the rows, and
no product crosses rows, so a row keeps its bits in any batch too; a shape takes one float tile for
every row count (its sums are not `_linear`'s bits). Not yet timed on a GPU.

A tile's sixth number quantizes a block layer's inputs to int8 instead (runtime/kernels/gpu/int8_linear.py,
the CPU kernels' arithmetic): its group sums are exact integers, so its GEMV and its tensor-core tile give
a row the same bits, and a shape may take one at some row counts and the other at the rest (`CHOSEN`'s
steps, `tile_for`; tiles of one `sum_order`). Not yet timed on a GPU either.

A GGUF's linear layers on a GPU with `quantize = "auto"` call it (runtime.model.gpu_blocks, loaded by
runtime.model.gguf_load); float weights still go through torch's matmuls (row padding keeps their rows
their own).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.gpu.block_codes import _codes, _inputs, _scales
from runtime.kernels.gpu.int8_linear import _int8_linear

TILE = (8, 512, 4)  # (outputs, inputs a chunk, warps) a program: from the shapes alone, never the rows
# Tiles the device check times (bench/gpu.py, `linear_sweep`); on an H200 (bench/results/gpu-nvidia-h200.json)
# TILE was within 20 % of the fastest at one row for every matmul of an 8B-shaped llama. A fourth number
# splits the inputs among that many programs a row and outputs (float32 sums, added up in order by a
# second launch): more programs in flight for a narrow layer, not yet timed on a GPU. A fifth, over 1, is
# the rows a program of `_tile_linear` (every row count padded to whole tiles of them): not yet timed either.
# A sixth, 1, quantizes a block layer's inputs to int8 (runtime/kernels/gpu/int8_linear.py: a row alone on
# the CUDA cores or sixteen on the tensor cores, the same bits in one sum order): not yet timed either.
TILES = ((32, 128, 4), (16, 256, 4), (8, 512, 4), (16, 512, 8), (8, 256, 2), (4, 1024, 4),
         (8, 512, 4, 2), (8, 512, 4, 4), (16, 256, 4, 8), (4, 1024, 4, 4),
         (64, 128, 4, 1, 16), (32, 128, 4, 1, 16), (32, 256, 4, 4, 16), (64, 256, 8, 2, 16),
         (16, 256, 4, 1, 1, 1), (32, 128, 4, 1, 1, 1), (8, 512, 4, 1, 1, 1), (16, 256, 4, 4, 1, 1),
         (64, 128, 4, 1, 16, 1), (32, 256, 4, 1, 16, 1), (64, 256, 8, 4, 16, 1), (32, 256, 4, 4, 16, 1))
# A layer shape's tiles where they were chosen for it, (outputs, inputs, packed) -> ((rows from, tile), ...)
# in rising rows: one tile, or int8 inputs' tiles of one sum order (`sum_order`), so every row count of that
# shape still gives a row the same bits (runtime.model.gpu_tiles fills it at start-up; the device check too)
CHOSEN: dict[tuple[int, int, bool], tuple[tuple[int, tuple[int, ...]], ...]] = {}


@triton.jit
def _dot(x_row, w_ptr, h_ptr, d_ptr, m_ptr, ds_ptr, ms_ptr, rn, out_ok, k_start, w_stride, h_stride, d_stride,
         ds_stride, INS: tl.constexpr, GROUP: tl.constexpr, BLOCKS: tl.constexpr, HAS_M: tl.constexpr,
         SUPER: tl.constexpr, PACKED: tl.constexpr, HIGH: tl.constexpr, OFFSET: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, ACT: tl.constexpr = 0):
    """The float32 sums of outputs `rn` (of the weights at `w_ptr`, their scales at `d_ptr`...) over the
    row at `x_row` (`_inputs`' with `ACT`), inputs `k_start` to `k_start + CHUNK` in chunks of `BLOCK_K`, in
    order (`_codes`' codes, times their group's scale, plus its offset, each product summed)."""
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for i in range(0, CHUNK, BLOCK_K):  # (the width a constant: one compiled kernel per layer shape)
        k0 = k_start + i
        rk = k0 + tl.arange(0, BLOCK_K)
        x = _inputs(x_row, rk, rk < INS, INS, ACT).to(tl.float32)
        w = _codes(w_ptr, h_ptr, rn, out_ok, k0, w_stride, h_stride, INS, PACKED, HIGH, OFFSET, BLOCK_N, BLOCK_K)
        if BLOCKS:  # codes -> weights: d * q (+ m), one (d, m) per GROUP input features, loaded once a group
            rg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            group = rn[:, None] * d_stride + rg[None, :]
            group_ok = out_ok[:, None] & (rg[None, :] < INS // GROUP)
            w = tl.reshape(w, (BLOCK_N, BLOCK_K // GROUP, GROUP))
            d = tl.load(d_ptr + group, mask=group_ok, other=0).to(tl.float32)
            if SUPER:  # a K-quant's: its super-block's scale times the group's integer sub-scale (gguf's product)
                supers = rn[:, None] * ds_stride + rg[None, :] // SUPER
                d = tl.load(ds_ptr + supers, mask=group_ok, other=0.0) * d
            w = w * d[:, :, None]
            if HAS_M:
                m = tl.load(m_ptr + group, mask=group_ok, other=0).to(tl.float32)
                if SUPER:
                    m = tl.load(ms_ptr + supers, mask=group_ok, other=0.0) * m
                w = w + m[:, :, None]
            w = tl.reshape(w, (BLOCK_N, BLOCK_K))
        acc += tl.sum(w * x[None, :], axis=1)
    return acc


@triton.jit
def _linear(x_ptr, w_ptr, h_ptr, d_ptr, m_ptr, ds_ptr, ms_ptr, out_ptr, outs, rows, x_stride, w_stride, h_stride,
            d_stride, ds_stride, out_stride, INS: tl.constexpr, GROUP: tl.constexpr, BLOCKS: tl.constexpr,
            HAS_M: tl.constexpr, SUPER: tl.constexpr, PACKED: tl.constexpr, HIGH: tl.constexpr, OFFSET: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr,
            ACT: tl.constexpr):
    row = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)  # the inputs split * CHUNK .. (split + 1) * CHUNK
    out_ok = rn < outs
    acc = _dot(x_ptr + row * x_stride, w_ptr, h_ptr, d_ptr, m_ptr, ds_ptr, ms_ptr, rn, out_ok, split * CHUNK, w_stride,
               h_stride, d_stride, ds_stride, INS, GROUP, BLOCKS, HAS_M, SUPER, PACKED, HIGH, OFFSET, BLOCK_N, BLOCK_K,
               CHUNK, ACT)
    if SPLITS == 1:
        tl.store(out_ptr + row * out_stride + rn, acc.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:  # a split's float32 sums `[SPLITS, rows, outs]`, added up in order by `_sum_splits`
        tl.store(out_ptr + (split * rows + row) * outs + rn, acc, mask=out_ok)


@triton.jit
def _tile_linear(x_ptr, w_ptr, h_ptr, d_ptr, m_ptr, ds_ptr, ms_ptr, out_ptr, outs, rows, x_stride, w_stride, h_stride,
                 d_stride, ds_stride, out_stride, INS: tl.constexpr, GROUP: tl.constexpr, BLOCKS: tl.constexpr,
                 HAS_M: tl.constexpr, SUPER: tl.constexpr, PACKED: tl.constexpr, HIGH: tl.constexpr,
                 OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLITS: tl.constexpr, CHUNK: tl.constexpr, ACT: tl.constexpr, DOT: tl.constexpr,
                 IEEE: tl.constexpr):
    """`BLOCK_M` rows (a fixed tile, rows past the last read as zeros) times `BLOCK_N` outputs a program,
    each weight read once for them all: a group's codes times its rows on the tensor cores (`tl.dot` in
    `DOT`, every product exact: a code is a small integer, a row's value a `DOT` already), then scaled,
    d * sum(x q) + m * sum(x), in float32 a group at a time, groups in order."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_ok, out_ok = rm < rows, rn < outs
    STEP: tl.constexpr = GROUP if BLOCKS else BLOCK_K  # (a group's inputs a product: its scale after)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for i in range(0, CHUNK, BLOCK_K):
        for j in tl.static_range(0, BLOCK_K, STEP):
            k0 = split * CHUNK + i + j
            rk = k0 + tl.arange(0, STEP)
            x = _inputs(x_ptr + rm[:, None] * x_stride, rk[None, :], row_ok[:, None] & (rk[None, :] < INS), INS,
                        ACT).to(DOT)
            w = tl.trans(_codes(w_ptr, h_ptr, rn, out_ok, k0, w_stride, h_stride, INS, PACKED, HIGH, OFFSET, BLOCK_N,
                                STEP).to(DOT))
            if IEEE:  # (float32 operands: exact float32 products, not the tensor cores' tf32)
                part = tl.dot(x, w, input_precision="ieee")
            else:
                part = tl.dot(x, w)
            if BLOCKS:
                d, m = _scales(d_ptr, m_ptr, ds_ptr, ms_ptr, rn, out_ok, k0 // GROUP, d_stride, ds_stride,
                               INS // GROUP, HAS_M, SUPER)
                acc += part * d[None, :]
                if HAS_M:
                    acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * m[None, :]
            else:
                acc += part
    keep = row_ok[:, None] & out_ok[None, :]
    if SPLITS == 1:
        tl.store(out_ptr + rm[:, None] * out_stride + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=keep)
    else:
        tl.store(out_ptr + (split * rows + rm[:, None]) * outs + rn[None, :], acc, mask=keep)


@triton.jit
def _sum_splits(part_ptr, out_ptr, outs, rows, out_stride, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < outs
    acc = tl.load(part_ptr + row * outs + cols, mask=inside, other=0.0)
    for split in tl.static_range(1, SPLITS):  # (first to last: one order whatever the rows)
        acc += tl.load(part_ptr + (split * rows + row) * outs + cols, mask=inside, other=0.0)
    tl.store(out_ptr + row * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)


def _launch(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor | None, m: torch.Tensor | None,
            packed: bool = False, tile: tuple[int, ...] | None = None, supers: tuple | None = None,
            high: torch.Tensor | None = None, offset: int = 0, act: int = 0) -> torch.Tensor:
    """`tile` (outputs, inputs a chunk, warps[, splits[, rows[, int8]]]): the sweep's; else the shape's at
    these rows (`tile_for`); `rows` over 1 makes it `_tile_linear`'s (that many rows a program, on the
    tensor cores), `int8` 1 `_int8_linear`'s (inputs quantized to int8, a GEMV at one row a program).
    `supers` (d's, m's or None): float32 super-block scales `[out, supers]` that `d` and `m`, integer
    sub-scales then, multiply. `high`, `offset`: packed codes' two high bits and what they are less.
    `act` (1 SiLU, 2 GELU's tanh form): `x` `[rows, 2 * in]` is a gate/up output, the inputs act(gate) * up."""
    rows, ins = x.shape[0], x.shape[1] // (2 if act else 1)
    outs = w.shape[0]
    assert w.shape[1] * (2 if packed else 1) == ins and x.stride(1) == 1 and w.stride(1) == 1
    out = torch.empty((rows, outs), dtype=x.dtype, device=x.device)
    group = ins // d.shape[1] if d is not None else 1
    block_n, block_k, warps, splits, block_m, ints = unpack(tile or tile_for((outs, ins, packed), rows))
    block_k = max(block_k, group)
    assert block_k % group == 0, f"a chunk of {block_k} inputs holds no whole number of groups of {group}"
    assert block_m == 1 or min(block_m, block_n, group if d is not None else block_k) >= 16, \
        "a tensor-core tile multiplies at least 16 rows, outputs and inputs at a time"
    assert not ints or (d is not None and ins % 32 == 0 and block_k % 32 == 0), \
        "int8 inputs are for blocks, a group of 32 inputs at a time"
    if not rows:
        return out
    chunk = triton.cdiv(ins, splits * block_k) * block_k  # (a split's inputs: whole chunks)
    parts = out if splits == 1 else torch.empty((splits, rows, outs), dtype=torch.float32, device=x.device)
    # (rows fastest: a tile's programs for every row run together)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(outs, block_n), splits)
    ds, ms = supers or (None, None)
    per_super = 0 if ds is None else d.shape[1] // ds.shape[1]
    assert ds is None or (d.shape[1] == per_super * ds.shape[1] and (m is None) == (ms is None))
    assert high is None or (packed and high.shape[1] * 4 == ins and high.stride(1) == 1)
    args = (x, w, w if high is None else high, w if d is None else d, w if m is None else m, w if ds is None else ds,
            w if ms is None else ms, parts, outs, rows, x.stride(0), w.stride(0), 0 if high is None else high.stride(0),
            0 if d is None else d.stride(0), 0 if ds is None else ds.stride(0), out.stride(0))
    constants = dict(INS=ins, GROUP=group, BLOCKS=d is not None, HAS_M=m is not None, SUPER=per_super, PACKED=packed,
                     HIGH=high is not None, OFFSET=offset, BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=splits,
                     CHUNK=chunk, ACT=act, num_warps=warps)
    if ints:
        del constants["BLOCKS"]
        _int8_linear[grid](*args, BLOCK_M=block_m, **constants)
    elif block_m == 1:
        _linear[grid](*args, **constants)
    else:
        dot = dot_type(x, w)
        _tile_linear[grid](*args, BLOCK_M=block_m, DOT=_TRITON_TYPES[dot], IEEE=dot == torch.float32, **constants)
    if splits > 1:
        block = min(1024, triton.next_power_of_2(outs))
        _sum_splits[(rows, triton.cdiv(outs, block))](parts, out, outs, rows, out.stride(0), SPLITS=splits, BLOCK=block)
    return out


def unpack(tile: tuple[int, ...]) -> tuple[int, int, int, int, int, int]:
    """A tile's (outputs, inputs a chunk, warps, splits, rows a program, int8 inputs), the last three 1, 1, 0
    where it leaves them out."""
    return (*tile, *(1, 1, 0)[len(tile) - 3:])


def sum_order(tile: tuple[int, ...], ins: int) -> tuple:
    """What decides the order of a row's sums over `ins` inputs with `tile`: tiles of one order give a row the
    same bits (int8 inputs' tiles: their splits and a split's inputs; any other tile is its own order)."""
    _, block_k, _, splits, _, ints = unpack(tile)
    if not ints:
        return tuple(tile)
    return ("int8", splits, 0 if splits == 1 else triton.cdiv(ins, splits * block_k) * block_k)


def tile_for(key: tuple[int, int, bool], rows: int) -> tuple[int, ...]:
    """The tile a layer of shape `key` (outputs, inputs, packed) takes at `rows` rows: the last of its
    `CHOSEN` steps that starts at or below `rows` (TILE where none was chosen)."""
    tile = TILE
    for start, step in CHOSEN.get(key, ()):
        if start > rows:
            break
        tile = step
    return tile


_TRITON_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def dot_type(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The operands' type of a tensor-core tile's products of rows `x` and weights or codes `w`: on a GPU,
    x's 16-bit float where each product is exact in it (codes are small integers, or the weights are of
    that type); float32 otherwise (multiplied as float32, not tf32), and in Triton's interpreter, which
    multiplies no 16-bit floats."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and (w.dtype == x.dtype or not w.is_floating_point()):
        return x.dtype
    return torch.float32


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x `[rows, in]` @ weight `[out, in]`.T, each row's outputs its own bits whatever the rows."""
    return _launch(x, weight, None, None)


def block_linear(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                 packed: bool = False, tile: tuple[int, ...] | None = None,
                 supers: tuple[torch.Tensor, torch.Tensor | None] | None = None, high: torch.Tensor | None = None,
                 offset: int = 0, act: int = 0) -> torch.Tensor:
    """x `[rows, in]` times the weights `d * codes + m` (`codes` `[out, in]` int8 or uint8, `d` and `m`
    `[out, groups]` float32, runtime.model.gguf_blocks.Blocks), transposed; dequantized in registers.
    `packed`: `codes` `[out, in / 2]` holds two 4-bit codes a byte (`pack_nibbles`). `supers`: a
    K-quant's scales as the file holds them (`Blocks.compact`): `d` and `m` its int8 sub-scales, and
    (d's, m's) float32 super-block scales `[out, in / 256]` that multiply them, in the kernel, to gguf's
    float32 products (exactly: an 11-bit float16 value times a 6-bit integer). `high` `[out, in / 4]`:
    with `packed`, each code's two high bits four a byte (`pack_pairs`: 6-bit codes), and `offset` what
    the stored codes are less (a signed code stored unsigned). `act` (1 SiLU, 2 GELU's tanh form): `x`
    is a fused gate/up output `[rows, 2 * in]` and the layer's inputs are act(gate) * up, computed as
    it loads them (one launch fewer than elementwise.act_mul's, the same bits)."""
    width = codes.shape[1] * (2 if packed else 1)
    assert width % d.shape[1] == 0 and (m is None or m.shape == d.shape)
    if supers is None:
        d, m = d.float(), None if m is None else m.float()
    else:
        assert d.dtype == torch.int8 and (m is None or m.dtype == torch.int8)
        supers = tuple(None if t is None else t.float().contiguous() for t in supers)
    return _launch(x, codes, d.contiguous(), None if m is None else m.contiguous(), packed, tile, supers, high, offset,
                   act)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes `[out, in]` (uint8, 0..15) as `[out, in / 2]` bytes: input 2i low, 2i + 1 high."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def pack_pairs(bits: torch.Tensor) -> torch.Tensor:
    """2-bit values `[out, in]` (uint8, 0..3) as `[out, in / 4]` bytes: input 4i in bits 0-1, 4i + 1 in 2-3, ..."""
    return bits[:, 0::4] | (bits[:, 1::4] << 2) | (bits[:, 2::4] << 4) | (bits[:, 3::4] << 6)
