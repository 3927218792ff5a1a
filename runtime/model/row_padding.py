"""Row counts for which a matrix multiply gives every row the same bits whatever the other rows.

A BLAS picks its kernel (and its split of the reduction) by the shape of the call, so a token's
projections can change in the last bits with the number of tokens in the step: a sequence decoded
alone and the same sequence decoded beside others would not see identical logits, and a search's
scores would depend on how its paths were batched. At start-up the runner probes the linear layers
a step calls, at their full shapes, on the device and in the dtype it serves with: every row count
up to `SMALL_ROWS`, and every multiple of `BUCKET_ROWS` up to the largest step it will run, each
against one call of that largest size. Steps are padded up to the nearest count that agreed, so
batching never changes a result; no count is trusted without having been seen to agree. The layers
probed are those that run: where the lean decoder (runtime.model.decoder) serves the model, its fused
q/k/v and gate/up layers (built here, before the probe, and shared with the runner), not the
separate layers whose shapes never reach a kernel.

Decode attention batches queries by context window (runtime.model.attention); the probe checks that its
batched matmuls give each query the same bits whatever the batch count, at every window a query can
reach under `max_model_len` (`attention_windows`) and every batch count a group of that window can
hold (at most `ATTENTION_BATCH` queries, and at most `GATHER_TOKENS` keys). Where ponder's CPU
kernel attends instead (float32 on a CPU), each query is computed on its own in a fixed order, and
there is no batched matmul to probe. Where either check cannot
be passed (a device whose kernels are not deterministic run to run, or whose batched matmul depends
on the batch count), the deterministic mode is refused at start-up rather than served wrong.
"""

from __future__ import annotations

import bisect
import json
import logging

import torch
import torch.nn.functional as F

from runtime.model.attention import bucket_blocks
from runtime.kernels.cpu_kernels import KERNEL_CACHE_DTYPES, KernelUnavailable, attention_kernel
from runtime.kernels.gpu import attends as gpu_attends
from runtime.model.decoders import build_decoder
from storage.kv_cache import attention_sizes

SMALL_ROWS = 48  # every row count up to this is probed
BUCKET_ROWS = 64  # above it, steps are padded to multiples of this, each probed
ATTENTION_BATCH = 64  # most queries of one window a decode attention group holds
# Most keys one decode attention group gathers (queries x window): runtime.model.model_runner.GATHER_TOKENS,
# which imports this module (tests/runtime/model/test_row_padding.py checks that the two agree).
GATHER_TOKENS = 1 << 16

log = logging.getLogger("ponder.runtime")
# The sources whose code decides which layers and attention run, and how they are probed.
_CODE = ("model/row_padding.py", "model/decoder.py", "model/layer_stack.py", "model/experts.py", "model/norms.py",
         "model/quantize.py", "model/float_layers.py", "model/attention.py",
         "kernels/cpu_kernels.py")


class InvarianceUnavailable(RuntimeError):
    """Batch invariance cannot be shown on this device: the deterministic mode is refused."""


def padding_for(model: torch.nn.Module, setting: bool | str, max_rows: int, max_head_rows: int | None = None, *,
                max_model_len: int | None = None, block_size: int = 16, cache: dict | None = None) -> "RowPadding | None":
    """The padding that keeps `model`'s rows their own under `scheduler.batch_invariant` = `setting`,
    or None where results may depend on the batch. True: probed, and `InvarianceUnavailable` stops
    start-up. auto (the default): probed, and where the device cannot be shown to compute row by row,
    one warning says what that means for seeds and the model is served without. False: not probed.
    `cache` (the model's identity, from the start-up): on a CPU the probe's verdict is kept in the
    start-up cache, so a later start with the same model, settings, threads, libraries and ponder
    reads it instead of probing again (seconds for float32 layers)."""
    if setting is False:
        return None
    try:
        return _verdict(model, max_rows, max_head_rows, max_model_len, block_size, cache)
    except InvarianceUnavailable as exc:
        if setting is True:
            raise
        log.warning("batch invariance is off: %s. A seeded request may give other tokens when it shares a "
                    "step with other traffic or finds its prompt cached (scheduler.batch_invariant = true "
                    "refuses to start instead)", exc)
        return None


def _verdict(model: torch.nn.Module, max_rows: int, max_head_rows: int | None, max_model_len: int | None,
             block_size: int, cache: dict | None) -> "RowPadding":
    """`RowPadding.probe`'s result, read from the start-up cache where `cache` names the model and it
    runs on a CPU (a GPU's kernels are probed every start); a refusal is kept as well as a padding."""
    def probe() -> RowPadding:
        return RowPadding.probe(model, max_rows, max_head_rows, max_model_len=max_model_len, block_size=block_size)

    parameter = next(model.parameters())
    if cache is None or parameter.device.type != "cpu":
        return probe()
    from runtime.startup_cache import Entry, runtime_sources, sources_hash

    entry = Entry("invariance", {**cache, "rows": [max_rows, max_head_rows, max_model_len, block_size],
                                 "dtype": str(parameter.dtype), "threads": torch.get_num_threads(),
                                 "batched_attention": decode_attention_is_batched(
                                     parameter.device, parameter.dtype, _head_dim(_text_config(model))),
                                 "code": sources_hash(runtime_sources(*_CODE))})
    verdict = entry.read(lambda directory: json.loads((directory / "verdict.json").read_text()))
    if verdict is None:
        try:
            padding = probe()
            verdict = {"safe_counts": padding.safe_counts, "max_rows": padding.max_rows}
        except InvarianceUnavailable as exc:
            verdict = {"unavailable": str(exc)}
        entry.write(lambda directory: (directory / "verdict.json").write_text(json.dumps(verdict)))
    if "unavailable" in verdict:
        raise InvarianceUnavailable(verdict["unavailable"])
    return RowPadding(verdict["safe_counts"], verdict["max_rows"])


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
    def probe(cls, model: torch.nn.Module, max_rows: int = 2048, max_head_rows: int | None = None, *,
              max_model_len: int | None = None, block_size: int = 16) -> "RowPadding":
        """Probe the linear layers `model` runs up to `max_rows` rows (`max_head_rows` for the output
        head, which only sees the rows whose logits are kept), and decode attention at every window of
        `block_size`-token blocks a context of up to `max_model_len` tokens (default: the model's
        `max_position_embeddings`) reads; raise `InvarianceUnavailable` where the device cannot be
        shown to compute row by row."""
        experts = routed_experts(model)
        if experts:
            raise InvarianceUnavailable(
                f"the routed experts ({', '.join(experts)}) compute each expert's tokens as one matmul whose bits "
                "depend on how many tokens a step routes to it")
        max_rows = max(max_rows, 1)
        candidates = list(range(1, min(SMALL_ROWS, max_rows) + 1))
        candidates += list(range(BUCKET_ROWS, max_rows, BUCKET_ROWS))
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        shapes: dict[tuple, torch.nn.Linear] = {}
        for module in executed_linears(model):
            key = (module.in_features, module.out_features, module.bias is not None, module is head)
            shapes.setdefault(key, module)
        parameter = next(model.parameters())
        if not shapes and not decode_attention_is_batched(parameter.device, parameter.dtype,
                                                          _head_dim(_text_config(model)), block_size):
            return cls(list(range(1, max_rows + 1)), max_rows)  # every layer and attention: ponder's own kernels
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
        config = _text_config(model)
        if max_model_len is None:
            max_model_len = getattr(config, "max_position_embeddings", None) or 2048
        if decode_attention_is_batched(parameter.device, parameter.dtype, _head_dim(config), block_size):
            _probe_attention(model, attention_windows(max_model_len, block_size), generator)
        return cls([r for r in candidates if r not in failing], max_rows)

    def __repr__(self) -> str:
        small = [r for r in self.safe_counts if r <= SMALL_ROWS]
        return f"RowPadding(small={small}, buckets={len(self.safe_counts) - len(small)}, max={self.max_rows})"


def routed_experts(model: torch.nn.Module) -> list[str]:
    """The classes of `model`'s modules holding a stack of experts' weights (a parameter of three or more
    dimensions, `[experts, ...]`, convolutions aside): transformers computes each expert over the tokens
    routed to it, a row count no padding controls, so the probe cannot show their rows to be their own."""
    return list(dict.fromkeys(type(module).__name__ for module in model.modules()
                              if not isinstance(module, torch.nn.modules.conv._ConvNd)
                              and any(p.dim() >= 3 for p in module.parameters(recurse=False))))


def _round_up(rows: int) -> int:
    """The probed count a step of `rows` rows can be padded to at most."""
    return rows if rows <= SMALL_ROWS else -(-rows // BUCKET_ROWS) * BUCKET_ROWS


def executed_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The `nn.Linear` layers a step of `model` calls. Where the lean decoder serves the model (built
    here if it was not yet, so its q/k/v and gate/up layers are fused), those are its fused layers in
    place of the layers whose weights became views of theirs; otherwise every `nn.Linear` of the model."""
    decoder = build_decoder(model)
    fused = [] if decoder is None else [
        projections.fused for layer in decoder.layers for projections in (layer.qkv, layer.gate_up)
        if projections is not None and isinstance(projections.fused, torch.nn.Linear)]
    parts = {layer.weight.untyped_storage().data_ptr() for layer in fused}
    return [module for module in model.modules() if isinstance(module, torch.nn.Linear)
            and module.weight.untyped_storage().data_ptr() not in parts] + fused


def attention_windows(max_model_len: int, block_size: int) -> list[tuple[int, int]]:
    """(window in tokens, most queries a group of that window holds) for every window decode
    attention reads (runtime.model.model_runner groups queries by `bucket_blocks` of their context's
    blocks) for contexts of 1 to `max_model_len` tokens in blocks of `block_size` tokens."""
    num_blocks = -(-max(max_model_len, 1) // block_size)
    widths = sorted({bucket_blocks(n) * block_size for n in range(1, num_blocks + 1)})
    return [(width, max(1, min(ATTENTION_BATCH, GATHER_TOKENS // width))) for width in widths]


def decode_attention_is_batched(device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int = 16) -> bool:
    """Whether decode attention runs as batched matmuls over groups of one window, or (False) ponder's
    CPU kernel attends each query alone: a float32 or bfloat16 cache on a CPU, `head_dim` a multiple of 8, and the
    kernel built (runtime.model.model_runner's `_attention_kernel`; tests/runtime/model/test_row_padding.py checks
    that the two agree); or on a CUDA device, ponder's Triton kernel (runtime.kernels.gpu.attends)."""
    if gpu_attends(device, block_size):
        return False
    if device.type != "cpu" or dtype not in KERNEL_CACHE_DTYPES or head_dim % 8:
        return True
    try:
        attention_kernel()
    except KernelUnavailable:
        return True
    return False


def _text_config(model: torch.nn.Module):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def _head_dim(config) -> int:
    return attention_sizes(config)[1]


def _probe_attention(model: torch.nn.Module, windows: list[tuple[int, int]], generator: torch.Generator) -> None:
    """Decode attention's batched matmuls (scores in float32, weights @ values in the model dtype)
    must give a query the same bits in every batch count a group of its window can hold as in the
    largest."""
    config = _text_config(model)
    heads = config.num_attention_heads
    kv_heads, head_dim = attention_sizes(config)
    parameter = next(model.parameters())
    for width, most in windows:
        q = torch.randn(most, kv_heads, heads // kv_heads, head_dim, generator=generator)
        k = torch.randn(most, kv_heads, width, head_dim, generator=generator)
        q, k = q.to(parameter.device), k.to(parameter.device)
        v = torch.randn(k.shape, generator=generator).to(parameter.device, parameter.dtype)
        scores = torch.softmax(torch.matmul(q, k.transpose(-1, -2)), dim=-1)
        weights = scores.to(parameter.dtype)
        reference_scores, reference_out = scores, torch.matmul(weights, v)
        for batch in range(1, most):
            same = torch.equal(torch.softmax(torch.matmul(q[:batch], k[:batch].transpose(-1, -2)), dim=-1),
                               reference_scores[:batch]) and \
                torch.equal(torch.matmul(weights[:batch], v[:batch]), reference_out[:batch])
            if not same:
                raise InvarianceUnavailable(
                    f"decode attention on {parameter.device} ({parameter.dtype}, window {width}) gives a query "
                    f"different bits in a batch of {batch} than in one of {most}")
