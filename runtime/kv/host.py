"""What the KV room's long-lived parts ask of the engine (their ports); the engine satisfies them.

The engine builds its compute pool (KV tensor, block pool, KV manager, scheduler, runner) once, when
it is made (under `token` sized to the blocks the tiers hold), and the residency over it then; it
re-chooses the batch caps as its search load changes, so those are read through these ports at each
use. What stays fixed (the model, the settings) is handed over when the part is made.
"""

from __future__ import annotations

from typing import Protocol

from runtime.kv.residency import Residency
from runtime.model.model_runner import ModelRunner
from scheduler.kv_manager import KVManager
from scheduler.roofline import BatchCaps
from scheduler.scheduler import Scheduler
from storage.block_pool import BlockPool
from storage.kv_cache import KVCache


class PoolHost(Protocol):
    """The compute pool as it is now, its queues, and where the KV below it lives if tiers are attached."""

    @property
    def pool(self) -> BlockPool: ...

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def residency(self) -> Residency | None: ...


class PlannerHost(PoolHost, Protocol):
    """For `runtime.kv.beam_groups.StepPlanner`: what a search step's groups must fit."""

    @property
    def kv(self) -> KVManager: ...

    @property
    def kv_caps(self) -> BatchCaps | None: ...


class StreamHost(PoolHost, Protocol):
    """For `runtime.kv.headwise.HeadwiseResidency`: the compute tier it borrows whole, and the runner
    that runs a streamed request's forwards again when its KV is rebuilt."""

    @property
    def cache(self) -> KVCache: ...

    @property
    def runner(self) -> ModelRunner: ...
