"""Row counts for which a matrix multiply gives every row the same bits whatever the other rows.

A BLAS picks its kernel (and its split of the reduction) by the shape of the call, so a token's
projections can change in the last bits with the number of tokens in the step: a sequence decoded
alone and the same sequence decoded beside others would not see identical logits, and a search's
scores would depend on how its paths were batched. At start-up the runner probes the model's own
linear layers, at their full shapes, on the device and in the dtype it serves with: every row count
up to `SMALL_ROWS`, and every multiple of `BUCKET_ROWS` up to the largest step it will run, each
against one call of that largest size. Steps are padded up to the nearest count that agreed, so
batching never changes a result; no count is trusted without having been seen to agree.

Decode attention batches queries by context window (runtime.attention); the probe checks that its
batched matmuls give each query the same bits whatever the batch count. Where either check cannot
be passed (a device whose kernels are not deterministic run to run, or whose batched matmul depends
on the batch count), the deterministic mode is refused at start-up rather than served wrong.
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

SMALL_ROWS = 48  # every row count up to this is probed
BUCKET_ROWS = 64  # above it, steps are padded to multiples of this, each probed
ATTENTION_BATCH = 64  # batch counts of decode attention probed (queries of one window)
ATTENTION_WIDTHS = (16, 64, 256)  # context windows, in tokens, the attention probe uses


class InvarianceUnavailable(RuntimeError):
    """Batch invariance cannot be shown on this device: the deterministic mode is refused."""


class RowPadding:
    def __init__(self, safe_counts: list[int], max_rows: int) -> None:
        """`safe_counts`: row counts that agree with a call of `max_rows` rows (itself safe).
        `max_rows` 0: no padding at all."""
        self.safe_counts = sorted(set(safe_counts) | {max_rows}) if max_rows else []
        self.max_rows = max_rows

    def pad(self, rows: int) -> int:
        """The smallest row count >= `rows` that gives each row the same bits as any other."""
        if not self.max_rows:
            return rows
        i = bisect.bisect_left(self.safe_counts, rows)
        if i == len(self.safe_counts):
            raise ValueError(f"a step of {rows} rows is larger than the {self.max_rows} rows probed")
        return self.safe_counts[i]

    @classmethod
    def none(cls) -> "RowPadding":
        return cls([], 0)

    @classmethod
    @torch.inference_mode()
    def probe(cls, model: torch.nn.Module, max_rows: int = 2048, max_head_rows: int | None = None) -> "RowPadding":
        """Probe `model`'s linear layers up to `max_rows` rows (`max_head_rows` for the output head,
        which only sees the rows whose logits are kept); raise `InvarianceUnavailable` where the
        device cannot be shown to compute row by row."""
        max_rows = max(max_rows, 1)
        candidates = list(range(1, min(SMALL_ROWS, max_rows) + 1))
        candidates += list(range(BUCKET_ROWS, max_rows, BUCKET_ROWS))
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        shapes: dict[tuple, torch.nn.Linear] = {}
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                key = (module.in_features, module.out_features, module.bias is not None, module is head)
                shapes.setdefault(key, module)
        failing: set[int] = set()
        generator = torch.Generator().manual_seed(0)
        head_rows = max_rows if max_head_rows is None else min(max_rows, _round_up(max_head_rows))
        for (_, _, _, is_head), module in shapes.items():
            limit = head_rows if is_head else max_rows
            weight, bias = module.weight, module.bias
            x = torch.randn(limit, module.in_features, generator=generator).to(weight.device, weight.dtype)
            reference = F.linear(x, weight, bias)
            if not torch.equal(F.linear(x, weight, bias), reference):
                raise InvarianceUnavailable(
                    f"a {tuple(weight.shape)} {weight.dtype} matmul on {weight.device} gives different bits "
                    "from one call to the next")
            for rows in candidates:
                if rows < limit and rows not in failing and \
                        not torch.equal(F.linear(x[:rows], weight, bias), reference[:rows]):
                    failing.add(rows)
        _probe_attention(model, generator)
        return cls([r for r in candidates if r not in failing], max_rows)

    def __repr__(self) -> str:
        small = [r for r in self.safe_counts if r <= SMALL_ROWS]
        return f"RowPadding(small={small}, buckets={len(self.safe_counts) - len(small)}, max={self.max_rows})"


def _round_up(rows: int) -> int:
    """The probed count a step of `rows` rows can be padded to at most."""
    return rows if rows <= SMALL_ROWS else -(-rows // BUCKET_ROWS) * BUCKET_ROWS


def _probe_attention(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Decode attention's batched matmuls (scores in float32, weights @ values in the model dtype)
    must give a query the same bits whatever the number of queries batched with it."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    parameter = next(model.parameters())
    for width in ATTENTION_WIDTHS:
        q = torch.randn(ATTENTION_BATCH, kv_heads, heads // kv_heads, head_dim, generator=generator)
        k = torch.randn(ATTENTION_BATCH, kv_heads, width, head_dim, generator=generator)
        q, k = q.to(parameter.device), k.to(parameter.device)
        v = torch.randn(k.shape, generator=generator).to(parameter.device, parameter.dtype)
        scores = torch.softmax(torch.matmul(q, k.transpose(-1, -2)), dim=-1)
        weights = scores.to(parameter.dtype)
        reference_scores, reference_out = scores, torch.matmul(weights, v)
        for batch in range(1, ATTENTION_BATCH):
            same = torch.equal(torch.softmax(torch.matmul(q[:batch], k[:batch].transpose(-1, -2)), dim=-1),
                               reference_scores[:batch]) and \
                torch.equal(torch.matmul(weights[:batch], v[:batch]), reference_out[:batch])
            if not same:
                raise InvarianceUnavailable(
                    f"decode attention on {parameter.device} ({parameter.dtype}, window {width}) gives a query "
                    f"different bits in a batch of {batch} than in one of {ATTENTION_BATCH}")
