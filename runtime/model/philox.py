"""Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) in torch integer
operators: every row's draw is a pure function of (seed, position), computed for all rows at once on
the rows' device with a fixed number of elementwise operators (no generator state, nothing on the host,
so a CUDA graph can hold it). The outputs are Random123's reference bits (tested against its
known-answer vectors)."""

from __future__ import annotations

import torch

_MASK = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # the round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # the key schedule's increments (golden ratio, sqrt(3) - 1)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32 bits of the 64-bit product of the constant `a` and `b` (values below 2**32), in int64
    arithmetic that never overflows: `b` split in 16-bit halves."""
    low_part = a * (b & 0xFFFF)  # < 2**48
    high_part = a * (b >> 16)  # < 2**48
    partial = low_part + ((high_part & 0xFFFF) << 16)  # < 2**49
    return (high_part >> 16) + (partial >> 32), partial & _MASK


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor],
               rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """The four 32-bit output words (int64 tensors) of Philox4x32 for four counter words and two key words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for i in range(rounds):
        if i:
            k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def uniforms(keys: torch.Tensor) -> torch.Tensor:
    """One float32 draw in [0, 1) per column of `keys` `[2, rows]` (int64 seeds (63-bit), then positions):
    the first word of Philox4x32-10 with key the seed and counter (position, 0, 0, 0), its top 24 bits
    over 2**24 (every value exact in float32, never 1). One host-to-device copy of `keys` a step."""
    seeds, positions = keys[0], keys[1]
    zero = torch.zeros_like(positions)
    word = philox4x32((positions & _MASK, positions >> 32, zero, zero), (seeds & _MASK, (seeds >> 32) & _MASK))[0]
    return (word >> 8).to(torch.float32) * (1.0 / (1 << 24))
