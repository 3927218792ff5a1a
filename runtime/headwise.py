"""Head-wise KV offloading for one very long sequence (after HeadInfer): the compute tier holds a
budget of (block, layer, KV-head group) pieces, the host and disk tiers hold the rest, and decoding
stays exact.

Per forward, per layer, per KV-head group (a slice): the slice's pieces are loaded into a staging
buffer (the next slice's load runs while this one computes), the query heads of that group attend
the slice's whole context, and the new full blocks are written back (or kept, if resident). The
prompt is prefilled in chunks through the same path, so the whole KV is never in compute at once.
`head_pieces` says which pieces stay resident and how the budget is spent.

Exactness: each head attends its full context with one softmax, through SDPA's math backend,
whose per-head result does not depend on which heads share the call (the fused CPU and CUDA
kernels split work by head count, which changes the last bits). So the logits do not depend on the
budget, the group size or the tiers, and greedy tokens match transformers' `generate`.

A piece that is missing or fails its disk checksum raises `PieceLost` and is never served.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from runtime.offload.head_pieces import HeadwiseStore, PieceLost, PiecePlan, plan_pieces
from runtime.offload.pipeline import LayerPipeline
from storage.disk_tier import DiskTier
from storage.host_tier import HostTier
from storage.tiers import TierChain

HEADWISE_ATTENTION = "ponder_headwise"
META_KWARG = "ponder_headwise"
COMPUTE = "compute"  # the compute tier's name in the transfer counters

__all__ = ["HeadwiseDecoder", "HeadwiseReport", "HeadwiseSpec", "PieceLost", "attend",
           "generate_headwise"]


@dataclass(frozen=True)
class HeadwiseSpec:
    budget_pieces: int  # compute-tier pieces: one (block, layer, KV-head group) each
    block_size: int = 16
    group_heads: int = 1  # KV heads per group
    prefill_chunk: int = 256  # prompt tokens per prefill forward
    prefetch: bool = True  # load slice i+1 while slice i computes (a second staging buffer)
    host_bytes: int | None = None  # host tier (whole pieces); None: the sequence's whole KV
    disk_dir: str | None = None  # None: no disk tier
    disk_bytes: int = 0
    disk_blocks_per_group: int = 16
    disk_reuse_groups: int = 4


@dataclass
class HeadwiseReport:
    tokens: list[int]
    budget_pieces: int
    piece_bytes: int
    total_pieces: int  # the sequence's whole KV at its longest
    resident_pieces: int
    compute_bytes: int  # KV tensors held in the compute tier (resident, tails, staging)
    pieces_loaded: int
    pieces_written: int
    loads_per_forward: list[int]  # prefill chunks first, then one per decoded token
    bytes_moved: dict[str, int]
    prefill_seconds: float
    decode_seconds: float
    stall_seconds: float  # blocked waiting for loads
    writeback_seconds: float  # copying new pieces off the compute tier
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def bytes_in(self) -> int:
        return sum(n for pair, n in self.bytes_moved.items() if pair.endswith("/" + COMPUTE))

    @property
    def bytes_out(self) -> int:
        return sum(n for pair, n in self.bytes_moved.items() if pair.startswith(COMPUTE + "/"))

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """`[1, H, T, D]` queries over `[1, KVH, ctx, D]` keys/values; every head's math is the same
    whichever heads share the call."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                              enable_gqa=True)


@dataclass
class _Forward:
    store: HeadwiseStore
    start: int
    end: int
    mask: torch.Tensor | None  # [T, end] for a chunk, None for one token


def headwise_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       **kwargs):
    fwd: _Forward = kwargs[META_KWARG]
    store, start, end = fwd.store, fwd.start, fwd.end
    plan = store.plan
    gh = plan.group_heads
    rep = query.shape[1] // key.shape[1]  # query heads per KV head
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, H, D]
    for group in range(plan.num_groups):
        s = module.layer_idx * plan.num_groups + group
        kv_heads = slice(group * gh, (group + 1) * gh)
        q_heads = slice(group * gh * rep, (group + 1) * gh * rep)
        buf = store.acquire(s)
        buf[0, :, start:end] = key[0, kv_heads]
        buf[1, :, start:end] = value[0, kv_heads]
        o = attend(query[:, q_heads], buf[None, 0, :, :end], buf[None, 1, :, :end], fwd.mask,
                   scaling)
        out[:, q_heads] = o[0].transpose(0, 1)
        store.release(s, end)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    return None


def register() -> str:
    AttentionInterface.register(HEADWISE_ATTENTION, headwise_attention)
    AttentionMaskInterface.register(HEADWISE_ATTENTION, _no_mask)
    return HEADWISE_ATTENTION


class HeadwiseDecoder:
    """One sequence of up to `max_tokens` tokens decoded over a head-wise tiered KV. Use as a
    context manager: it switches the model's attention and restores it on exit."""

    def __init__(self, model, spec: HeadwiseSpec, max_tokens: int, *, model_key: bytes = b"") -> None:
        self.model = model
        self.spec = spec
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        config = model.config.get_text_config()
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.plan: PiecePlan = plan_pieces(
            num_layers=config.num_hidden_layers, num_kv_heads=num_kv_heads,
            group_heads=spec.group_heads, head_dim=head_dim, block_size=spec.block_size,
            max_tokens=max_tokens, budget_pieces=spec.budget_pieces, prefetch=spec.prefetch)
        # The group size and dtype change what a piece holds, so they are part of its name.
        extra_key = model_key + f"|{self.dtype}|gh{spec.group_heads}|bs{spec.block_size}".encode()
        self._workdir = tempfile.mkdtemp(prefix="kv-headwise-", dir=spec.disk_dir) \
            if spec.disk_dir else None
        self.chain = self._chain(extra_key)
        self.pipeline = LayerPipeline(self.chain, self.device)
        self.store = HeadwiseStore(self.plan, self.dtype, self.device, self.pipeline, extra_key)
        self.loads_per_forward: list[int] = []
        self.num_tokens = 0
        self._previous_attention = None

    def __enter__(self) -> "HeadwiseDecoder":
        self._previous_attention = self.model.config._attn_implementation
        self.model.set_attn_implementation(register())
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.pipeline.close()
        if self._previous_attention is not None:
            self.model.set_attn_implementation(self._previous_attention)
            self._previous_attention = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:
        """The prompt, `prefill_chunk` tokens per forward; float32 logits of its last token."""
        if self.num_tokens:
            raise RuntimeError("prefill runs once, first")
        chunk = self.spec.prefill_chunk
        logits = None
        for c in range(0, len(token_ids), chunk):
            logits = self._forward(list(token_ids[c:c + chunk]))
        if logits is None:
            raise ValueError("an empty prompt")
        return logits

    @torch.inference_mode()
    def decode(self, token_id: int) -> torch.Tensor:
        """Append one token; float32 logits of the next."""
        return self._forward([token_id])

    def _forward(self, token_ids: list[int]) -> torch.Tensor:
        start, end = self.num_tokens, self.num_tokens + len(token_ids)
        self.store.begin(token_ids, start)
        mask = None
        if len(token_ids) > 1:  # query i (position start + i) sees keys up to its own position
            rows = torch.arange(start, end, device=self.device)[:, None]
            mask = torch.arange(end, device=self.device)[None, :] <= rows
        self.loads_per_forward.append(self.plan.loads(start))
        loaded = self.store.num_loaded
        out = self.model(input_ids=torch.tensor([token_ids], device=self.device),
                         position_ids=torch.arange(start, end, device=self.device)[None],
                         use_cache=False, logits_to_keep=1,
                         **{META_KWARG: _Forward(self.store, start, end, mask)})
        assert self.store.num_loaded - loaded == self.loads_per_forward[-1], "loads off plan"
        self.num_tokens = end
        return out.logits[0, -1].float()

    def _chain(self, extra_key: bytes) -> TierChain:
        spec, plan = self.spec, self.plan
        shape = (2, plan.group_heads, plan.block_size, plan.head_dim)
        piece_bytes = 2 * plan.group_heads * plan.block_size * plan.head_dim * \
            torch.empty((), dtype=self.dtype).element_size()
        host_bytes = plan.total_pieces * piece_bytes if spec.host_bytes is None else spec.host_bytes
        host = HostTier(shape, self.dtype, host_bytes, pin_memory=self.device.type == "cuda",
                        name="host") if host_bytes > 0 else None
        disk = None
        if self._workdir is not None and spec.disk_bytes > 0:
            disk = DiskTier(self._workdir, f"{extra_key.hex()}|{shape}", spec.disk_bytes,
                            blocks_per_group=spec.disk_blocks_per_group,
                            reuse_buffer_groups=spec.disk_reuse_groups, name="disk")
        # A streamed context is read once per token in order: promoting disk hits into a host
        # tier too small for it would only evict what the next slice reads.
        return TierChain(host, disk, compute_name=COMPUTE, promote_disk_hits=False)


def generate_headwise(model, prompt_ids: Sequence[int], max_new_tokens: int, spec: HeadwiseSpec, *,
                      model_key: bytes = b"", temperature: float = 0.0, seed: int = 0,
                      keep_logits: bool = False) -> HeadwiseReport:
    """Prefill `prompt_ids`, then decode `max_new_tokens` tokens (greedy, or sampled with a seeded
    generator when `temperature > 0`); EOS does not stop it."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    generator = torch.Generator().manual_seed(seed)

    def pick(logits: torch.Tensor) -> int:
        if temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.cpu() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    decoder = HeadwiseDecoder(model, spec, len(prompt_ids) + max_new_tokens - 1, model_key=model_key)
    kept: list[torch.Tensor] = []
    with decoder:
        began = time.perf_counter()
        logits = decoder.prefill(prompt_ids)
        _synchronize(decoder.device)
        prefill_seconds = time.perf_counter() - began
        tokens = [pick(logits)]
        kept.append(logits)
        began = time.perf_counter()
        for _ in range(max_new_tokens - 1):
            logits = decoder.decode(tokens[-1])
            tokens.append(pick(logits))
            kept.append(logits)
        _synchronize(decoder.device)
        decode_seconds = time.perf_counter() - began
        decoder.pipeline.close()  # every write-back done before the counters are read
        decoder.store.check_integrity()
        decoder.chain.check_integrity()
    store, plan = decoder.store, decoder.plan
    return HeadwiseReport(
        tokens=tokens, budget_pieces=plan.budget_pieces, piece_bytes=store.piece_bytes,
        total_pieces=plan.total_pieces, resident_pieces=plan.resident_pieces,
        compute_bytes=store.compute_bytes, pieces_loaded=store.num_loaded,
        pieces_written=store.num_written, loads_per_forward=list(decoder.loads_per_forward),
        bytes_moved=decoder.chain.bytes_moved, prefill_seconds=prefill_seconds,
        decode_seconds=decode_seconds, stall_seconds=decoder.pipeline.stall_seconds,
        writeback_seconds=store.writeback_seconds, logits=kept if keep_logits else [])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
