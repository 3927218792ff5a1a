"""Replay a search's block trace at another model's KV shape: bytes moved and modelled seconds of
locality-aware beam scheduling (`lbs`, `lbs_no_prefix`) against layer-wise token-by-token offload
(`token`). A model, not a measurement: every figure here is arithmetic on the trace.

A trace is the search's steps; each step lists its paths as the planner saw them when the step began
(the names of the full blocks each path holds, prefix first, equal names for shared blocks; its
tokens; the most tokens its step may decode) and the names its full blocks had when the step ended.

lbs: each step's paths are grouped by the engine's own grouping (`scheduler.grouping`, called as
`runtime.kv.beam_groups.StepPlanner` calls it) for the compute budget in blocks. The compute tier is an
LRU set of blocks of that many blocks. A group loads its blocks that are not resident, runs its
step, and leaves its blocks (read and written) resident; while it runs, the next group's missing
blocks are prefetched into the headroom the group leaves, overlapping its compute. The prompt's
blocks start resident (the prefill wrote them). Blocks a step writes go back to the host tier on the
other direction of the link, overlapped. lbs_no_prefix charges and loads every path's blocks as its
own copy: nothing is shared between paths.

token: every path decodes each token together; Eq. 1-2 (bench.transfer_model) give the bytes
reloaded per token, overlapped with compute layer by layer: a token takes the longer of the two.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from bench.transfer_model import KVLayout, layerwise_token_bytes
from scheduler.grouping import Beam, group_beams, order_groups
from scheduler.roofline import DevicePeaks, ModelCost


@dataclass(frozen=True)
class TracePath:
    blocks: tuple[Hashable, ...]  # full blocks when the step began, prefix first
    num_tokens: int
    step_tokens: int  # the most tokens the step may decode for this path
    blocks_after: tuple[Hashable, ...]  # full blocks when the step ended


@dataclass(frozen=True)
class TraceStep:
    paths: tuple[TracePath, ...]


@dataclass(frozen=True)
class Device:
    peaks: DevicePeaks  # compute and device-memory bandwidth, for the roofline
    link_bandwidth: float  # bytes/s host -> device (each direction)


@dataclass
class Outcome:
    policy: str
    bytes_in: int = 0  # host -> compute
    bytes_out: int = 0  # compute -> host (the KV a step writes)
    seconds: float = 0.0
    stall_seconds: float = 0.0  # transfer time not hidden behind compute
    num_groups: int = 0

    @property
    def stall_share(self) -> float:
        return self.stall_seconds / self.seconds if self.seconds else 0.0


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _beams(step: TraceStep, block_size: int, share: bool) -> list[Beam]:
    """The step's paths as the planner sees them; without sharing, each path's blocks are its own."""
    beams = []
    for i, path in enumerate(step.paths):
        keys = path.blocks if share else tuple((i, k) for k in path.blocks)
        beams.append(Beam(i, keys, max(0, blocks_for(path.num_tokens + path.step_tokens, block_size) - len(keys))))
    return beams


def compute_seconds(cost: ModelCost, peaks: DevicePeaks, paths: Sequence[TracePath], step_tokens: int) -> float:
    """Decoding `step_tokens` tokens for `paths` together, token by token, at the roofline."""
    context = sum(p.num_tokens for p in paths) / len(paths)
    return sum(cost.decode_latency(peaks, len(paths), round(context + t)) for t in range(step_tokens))


def replay_lbs(trace: Sequence[TraceStep], layout: KVLayout, cost: ModelCost, device: Device, budget_blocks: int,
               block_size: int, share_prefix: bool = True, max_beams: int | None = None) -> Outcome:
    outcome = Outcome("lbs" if share_prefix else "lbs_no_prefix")
    block_bytes = block_size * layout.bytes_per_token
    resident: OrderedDict[Hashable, None] = OrderedDict()  # the compute tier, least recent first
    if trace and share_prefix:  # the prompt's blocks, written by the prefill
        for key in trace[0].paths[0].blocks[:budget_blocks]:
            resident[key] = None
    for step in trace:
        beams = _beams(step, block_size, share_prefix)
        groups = group_beams(beams, budget_blocks, share_prefix=share_prefix, max_beams=max_beams)
        if groups is None:
            raise ValueError(f"one path alone needs more than the {budget_blocks}-block budget")
        if share_prefix:
            groups = order_groups(groups, resident=list(resident))
        outcome.num_groups += len(groups)
        if not share_prefix:
            resident.clear()  # the paths' own copies do not outlive their step
        prefetched: set = set()
        for g, group in enumerate(groups):
            keys = list(group.block_ids)
            missing = [k for k in keys if k not in resident and k not in prefetched]
            demand = len(missing) * block_bytes  # loaded before the group can start
            paths = [step.paths[i] for i in group.beam_ids]
            tokens = max(p.step_tokens for p in paths)
            busy = compute_seconds(cost, device.peaks, paths, tokens)
            for k in keys:
                resident[k] = None
                resident.move_to_end(k)
            written = [(i, k) if not share_prefix else k for i in group.beam_ids
                       for k in step.paths[i].blocks_after[len(step.paths[i].blocks):]]
            for k in written:
                resident[k] = None
                resident.move_to_end(k)
            _evict(resident, budget_blocks)
            ahead = 0
            prefetched = set()
            if g + 1 < len(groups):  # into the headroom this group leaves, while it computes
                room = max(0, budget_blocks - group.num_blocks)
                upcoming = [k for k in groups[g + 1].block_ids if k not in resident][:room]
                prefetched = set(upcoming)
                ahead = len(upcoming) * block_bytes
            outcome.bytes_in += demand + ahead
            outcome.bytes_out += len(set(written)) * block_bytes
            stall = demand / device.link_bandwidth + max(0.0, ahead / device.link_bandwidth - busy)
            outcome.stall_seconds += stall
            outcome.seconds += busy + stall
            for k in prefetched:  # they land in the compute tier before the next group starts
                resident[k] = None
                resident.move_to_end(k)
            _evict(resident, budget_blocks, keep=prefetched)
    return outcome


def _evict(resident: OrderedDict, capacity: int, keep: set = frozenset()) -> None:
    """Drop least recently used blocks beyond `capacity`, never one in `keep`."""
    for key in list(resident):
        if len(resident) <= capacity:
            return
        if key not in keep:
            del resident[key]


def replay_token(trace: Sequence[TraceStep], layout: KVLayout, cost: ModelCost, device: Device,
                 budget_bytes: int) -> Outcome:
    """Every path decodes each token together (no groups); Eq. 1-2 bytes per token, with each path's
    KV its own (a per-path cache, as layer-wise offload keeps it)."""
    outcome = Outcome("token")
    for step in trace:
        paths = step.paths
        tokens = max(p.step_tokens for p in paths)
        context = sum(p.num_tokens for p in paths)
        for t in range(tokens):
            moved = layerwise_token_bytes(layout, context + t * len(paths), budget_bytes)
            busy = cost.decode_latency(device.peaks, len(paths), round(context / len(paths) + t))
            transfer = moved / device.link_bandwidth
            outcome.bytes_in += moved
            outcome.bytes_out += len(paths) * layout.bytes_per_token  # the token's new KV
            outcome.seconds += max(busy, transfer)
            outcome.stall_seconds += max(0.0, transfer - busy)
        outcome.num_groups += 1
    return outcome
