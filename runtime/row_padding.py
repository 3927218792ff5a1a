"""Row counts for which a matrix multiply gives every row the same bits whatever the other rows.

A BLAS picks its kernel (and its split of the reduction) by the shape of the call, so a token's
projections can change in the last bits with the number of tokens in the step: a sequence decoded
alone and the same sequence decoded beside others would not see identical logits, and a search's
scores would depend on how its paths were batched. On this kind of machine the effect is confined
to small row counts (e.g. below 4, or 5-7 and 9-11 with two threads). At start-up the runner probes
the model's own linear layers for the row counts that agree with a large call, and pads every
step's tokens (and every head's rows) up to the nearest such count, so batching never changes a
result. The probe runs under the thread count the engine will use.
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

_PROBE_ROWS = 48  # row counts probed; every count at or above the largest failing one + 1 is trusted
_REFERENCE_ROWS = 64
_MAX_OUT_FEATURES = 4096  # a slice of very wide layers (the vocabulary head) is enough to see the kernel


class RowPadding:
    def __init__(self, safe_counts: list[int], trusted_from: int) -> None:
        """`safe_counts`: row counts below `trusted_from` that agree with a large call."""
        self.safe_counts = sorted(safe_counts)
        self.trusted_from = trusted_from

    def pad(self, rows: int) -> int:
        """The smallest row count >= `rows` that gives each row the same bits as any other."""
        if rows >= self.trusted_from:
            return rows
        i = bisect.bisect_left(self.safe_counts, rows)
        return self.safe_counts[i] if i < len(self.safe_counts) else self.trusted_from

    @classmethod
    def none(cls) -> "RowPadding":
        return cls([], 1)

    @classmethod
    @torch.inference_mode()
    def probe(cls, model: torch.nn.Module) -> "RowPadding":
        shapes: dict[tuple[int, int, bool], torch.nn.Linear] = {}
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                shapes.setdefault((module.in_features, module.out_features, module.bias is not None), module)
        failing = set()
        generator = torch.Generator().manual_seed(0)
        for module in shapes.values():
            weight = module.weight[:_MAX_OUT_FEATURES]
            bias = module.bias[:_MAX_OUT_FEATURES] if module.bias is not None else None
            x = torch.randn(_REFERENCE_ROWS, module.in_features, generator=generator).to(weight.device, weight.dtype)
            reference = F.linear(x, weight, bias)
            for rows in range(1, _PROBE_ROWS + 1):
                if rows not in failing and not torch.equal(F.linear(x[:rows], weight, bias), reference[:rows]):
                    failing.add(rows)
        trusted_from = max(failing, default=0) + 1
        return cls([r for r in range(1, trusted_from) if r not in failing], trusted_from)

    def __repr__(self) -> str:
        return f"RowPadding(safe={self.safe_counts}, from={self.trusted_from})"
