"""What plain requests ask of the engine (their port); the engine satisfies it.

Every change they make to the compute pool's sequences goes through the port every room uses
(runtime.kv.sequence_host), and two of their own: a request over the compute pool streams head-wise,
and a prompt whose logprobs are asked for is admitted again with less of it cached. Plain requests
hold no reference to the scheduler or the KV manager. What stays fixed (the tokenizer, the limits)
is handed over when plain requests are made.
"""

from __future__ import annotations

from typing import Protocol

from runtime.kv.sequence_host import SequenceHost
from scheduler.sequence import Sequence


class RequestsHost(SequenceHost, Protocol):
    def stream_sequence(self, seq: Sequence) -> None: ...  # its KV outgrows the pool: head-wise (runtime.kv.headwise)

    def readmit(self, seq: Sequence, num_new_tokens: int, max_cached_tokens: int) -> bool:
        """Admit `seq` (admitted this step) again with at most `max_cached_tokens` tokens from the
        prefix cache, for the same `num_new_tokens`; False if its blocks do not fit."""
