"""What plain requests ask of the engine (their port); the engine satisfies it.

Only the compute pool's queues and KV manager are read through it: the engine owns them (it builds
them once, when it is made) and plain requests hold no reference of their own. What stays fixed (the
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
