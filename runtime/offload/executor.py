"""Runs one step-wise beam search with its KV spread over a compute tier of `budget_blocks` blocks,
a host tier and a disk tier, under one of three policies, and reports what it cost.

    token          the paper's baseline: token by token, layer-wise offload and reload
    lbs_no_prefix  beam groups decode whole steps while resident; no sharing between beams
    lbs            locality-aware beam scheduling: groups by shared blocks, shared blocks once

Each run builds its own compute tensor, tiers (a fresh directory under `disk_dir`) and transfer
worker, and restores the model's attention implementation when done. The tokens and scores do not
depend on the policy or the budget; the bytes and seconds do.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from runtime.engine import kv_shape_of
from runtime.offload import attention
from runtime.offload.block_store import BlockStore
from runtime.offload.grouped import GroupedPolicy
from runtime.offload.layerwise import LayerwisePolicy
from runtime.offload.names import BlockNames
from runtime.offload.pipeline import LayerPipeline
from runtime.offload.runner import OffloadRunner
from runtime.offload.search import BeamSearch, SearchSpec
from scheduler.kv_manager import KVManager
from storage.block_pool import BlockPool
from storage.disk_tier import DiskTier
from storage.host_tier import HostTier
from storage.kv_cache import KVCache
from storage.tiers import TierChain, TransferEngine

POLICIES = ("token", "lbs_no_prefix", "lbs")
COMPUTE = "compute"  # the compute tier's name in the transfer counters


@dataclass(frozen=True)
class TierSpec:
    budget_blocks: int  # compute-tier blocks (all layers of block_size tokens each)
    block_size: int = 16
    host_bytes: int = 0
    disk_dir: str | None = None  # None: no disk tier
    disk_bytes: int = 0
    disk_blocks_per_group: int = 8
    activation_reserve_bytes: int = 256 << 20  # CUDA: free memory a step leaves for activations


@dataclass(frozen=True)
class RunReport:
    policy: str
    budget_blocks: int
    block_bytes: int
    bytes_in: int  # into the compute tier, from the chain's counters
    bytes_out: int  # out of the compute tier (write-backs)
    bytes_moved: dict[str, int]  # every "src/dst" counter
    bytes_prefetched: int  # loads issued ahead of the compute that reads them
    seconds: float
    stall_seconds: float  # blocked on transfers: waiting for loads, handing off write-backs
    num_forwards: int
    group_sizes: tuple[tuple[int, ...], ...]  # per step: beams per group (token: all beams)
    group_blocks: tuple[tuple[int, ...], ...]  # per step: blocks each group was charged
    tokens: tuple[tuple[int, ...], ...]  # every final beam's generated tokens
    scores: tuple[float, ...]
    distinct_blocks: int = 0  # logical blocks the final beams hold, shared ones once
    max_resident_blocks: int | None = None  # grouped policies: most blocks resident at once
    resident_layers: tuple[int, ...] = field(default=())  # token: fewest resident layers per step

    @property
    def stall_share(self) -> float:
        return self.stall_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def groups_per_step(self) -> tuple[int, ...]:
        return tuple(len(g) for g in self.group_sizes)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["stall_share"] = self.stall_share
        out["groups_per_step"] = list(self.groups_per_step)
        return out


def budget_probe(configured: int, device: torch.device, block_bytes: int,
                 reserve_bytes: int) -> Callable[[], int]:
    """Blocks the compute tier may use now. On CUDA the pool is preallocated for `configured`
    blocks; when `torch.cuda.mem_get_info` shows less free memory than a step's activations
    need, the shortfall is taken from the pool. Elsewhere the configured budget."""
    if device.type != "cuda":
        return lambda: configured

    def probe() -> int:
        free, _ = torch.cuda.mem_get_info(device)
        short = max(0, reserve_bytes - free)
        return max(1, configured - (-(-short // block_bytes)))

    return probe


def run_offloaded(model, spec: SearchSpec, tiers: TierSpec, policy: str = "lbs", *,
                  model_key: bytes = b"", check: bool = False) -> RunReport:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
    name = attention.register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    workdir = tempfile.mkdtemp(prefix=f"kv-{policy}-", dir=tiers.disk_dir) if tiers.disk_dir else None
    try:
        return _run(model, spec, tiers, policy, model_key, workdir, check)
    finally:
        model.set_attn_implementation(previous)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def _run(model, spec: SearchSpec, tiers: TierSpec, policy: str, model_key: bytes,
         workdir: str | None, check: bool) -> RunReport:
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    shape = kv_shape_of(model.config, tiers.block_size)
    pool = BlockPool(spec.num_logical_blocks(tiers.block_size), tiers.block_size)
    kv = KVManager(pool, enable_prefix_cache=False)
    names = BlockNames(model_key)
    runner = OffloadRunner(model)
    block_bytes = shape.bytes_per_block(dtype)
    budget = budget_probe(tiers.budget_blocks, device, block_bytes, tiers.activation_reserve_bytes)
    is_grouped = policy != "token"
    payload_shape = shape.block_shape if is_grouped else shape.block_shape[1:]
    chain = _chain(payload_shape, dtype, device, tiers, workdir, model_key)
    if is_grouped:
        cache = KVCache(shape, tiers.budget_blocks, dtype, device)
        store = BlockStore(cache, chain, TransferEngine(chain, device=device), names)
        impl = GroupedPolicy(store, runner, kv, spec.step_tokens,
                             share_prefix=policy == "lbs", budget=budget)
    else:
        cache = KVCache(shape, pool.num_blocks, dtype, device)
        pipeline = LayerPipeline(chain, device)
        max_blocks = -(-spec.num_computed_tokens // tiers.block_size)
        impl = LayerwisePolicy(cache, pipeline, runner, kv, names, spec.step_tokens,
                               spec.num_beams, max_blocks, budget=budget)
    search = BeamSearch(spec, kv, impl, device)
    try:
        start = time.perf_counter()
        result = search.run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    finally:
        if is_grouped:
            store.close()
        else:
            pipeline.close()
    if check:
        pool.check_integrity([b.seq.block_table for b in search.beams])
        if is_grouped:
            store.check_integrity()
        else:
            chain.check_integrity()
    moved = chain.bytes_moved
    if is_grouped:
        stall, prefetched, max_resident = store.stall_seconds, store.bytes_prefetched, \
            store.residency.max_held
    else:
        stall, prefetched, max_resident = pipeline.stall_seconds + impl.writeback_seconds, \
            impl.bytes_prefetched, None
    return RunReport(
        policy=policy, budget_blocks=tiers.budget_blocks, block_bytes=block_bytes,
        bytes_in=sum(n for pair, n in moved.items() if pair.endswith("/" + COMPUTE)),
        bytes_out=sum(n for pair, n in moved.items() if pair.startswith(COMPUTE + "/")),
        bytes_moved=moved, bytes_prefetched=prefetched, seconds=seconds, stall_seconds=stall,
        num_forwards=runner.num_forwards,
        group_sizes=tuple(s.group_sizes for s in result.steps),
        group_blocks=tuple(s.group_blocks for s in result.steps),
        tokens=tuple(result.tokens), scores=tuple(result.scores),
        distinct_blocks=len({b for beam in search.beams for b in beam.seq.block_table}),
        max_resident_blocks=max_resident,
        resident_layers=() if is_grouped else tuple(impl.resident_per_step))


def _chain(payload_shape, dtype, device, tiers: TierSpec, workdir: str | None,
           model_key: bytes) -> TierChain:
    host = None
    if tiers.host_bytes > 0:
        host = HostTier(payload_shape, dtype, tiers.host_bytes, pin_memory=device.type == "cuda",
                        name="host")
    disk = None
    if workdir is not None and tiers.disk_bytes > 0:
        namespace = f"{model_key.hex()}|{dtype}|{tuple(payload_shape)}"
        disk = DiskTier(workdir, namespace, tiers.disk_bytes,
                        blocks_per_group=tiers.disk_blocks_per_group, name="disk")
    return TierChain(host, disk, compute_name=COMPUTE)
