"""What plain requests ask of the engine (their port); the engine satisfies it.

Only the compute pool's queues and KV manager are read through it: the engine builds them anew when
tiers are attached under `token`, so they are asked for at each use. What stays fixed (the
tokenizer, the limits, the head-wise residency) is handed over when plain requests are made.
"""

from __future__ import annotations

from typing import Protocol

from scheduler.kv_manager import KVManager
from scheduler.scheduler import Scheduler


class RequestsHost(Protocol):
    @property
    def kv(self) -> KVManager: ...

    @property
    def scheduler(self) -> Scheduler: ...
