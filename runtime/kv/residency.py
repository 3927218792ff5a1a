"""One interface to where each block's KV lives below the compute pool: the residency.

The engine holds one residency, or None when nothing lives below compute, and the runner calls it
around every step it computes (`ModelRunner.use_residency`). A residency owns its tiers below compute
(`chain`), every transfer between them and the compute pool, and the counters of those transfers;
the block pool keeps owning the blocks, and the scheduler the queues. Three modes implement it:

- `runtime.kv.kv_tiers.TieredPrefixCache`: whole named blocks go below compute when the pool
  reclaims them and come back as prefix hits before admission; a step's layers need nothing of it.
- `runtime.kv.layer_offload.LayerwiseResidency` (`policy = "token"`): the layers over the compute
  budget live below it and are reloaded around each layer of every step.
- `runtime.kv.headwise.HeadwiseResidency` (`kv_granularity = "head"`): a lone request over the pool
  has the compute tier to itself and streams (layer, KV-head group) pieces through it; it attends
  that request's steps itself (`attention`), and owns one of the two above when tiers are attached.
"""

from __future__ import annotations

from typing import Protocol

from runtime.model.model_runner import StepResidency
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from storage.piece_transfers import PieceLost
from storage.kv_cache import KVShape
from storage.tiers import TierChain


class Residency(StepResidency, Protocol):
    """What the engine asks of a residency beyond the runner's step hooks (`StepResidency`:
    `attention`, `begin_step`, `before_layer`, `after_layer`, `end_step`)."""

    @property
    def chain(self) -> TierChain | None: ...  # the host and disk tiers below the compute pool (head: if any)

    def bytes_moved(self) -> dict[str, int]:
        """Bytes moved between tiers, as {"src/dst": bytes}, since it was made (a copy)."""
        ...

    def stall_seconds(self) -> float:
        """Seconds the engine loop was blocked on its transfers since it was made."""
        ...

    def promote_prefix(self, seq: Sequence, limit: int | None = None) -> int:
        """Bring the blocks of `seq`'s prefix that live below compute into the pool as cached blocks
        before it is admitted, at most `limit` of them; returns how many came."""
        ...

    def recover(self, lost: PieceLost, scheduler: Scheduler) -> None:
        """A step raised `lost` before anything read the piece: make the KV whole again (or re-raise)."""
        ...

    def drain(self) -> None:
        """Wait until every transfer handed out so far has landed."""
        ...

    def block_counts(self) -> dict[str, int]:
        """The named blocks each tier below compute holds, as {"tier/state": count}."""
        ...

    def check_integrity(self) -> None:
        """AssertionError unless its tiers agree with themselves (tests, idle)."""
        ...

    def close(self) -> None:
        """Keep what can outlive the process, then stop its transfers."""
        ...


def tier_payload(shape: KVShape, policy: str) -> tuple[int, ...]:
    """What one slot of a host tier below the compute pool holds under `policy`: a whole block, or
    (`token`, layer by layer) one layer of one."""
    return shape.block_shape[1:] if policy == "token" else shape.block_shape

