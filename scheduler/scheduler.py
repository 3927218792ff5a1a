"""Continuous batching: which sequences run this step, within a token budget and the KV blocks free.

Running sequences go first (decode, or the next chunk of a long prefill); waiting ones are admitted
while the budget and the pool allow. When a running sequence cannot get a block, the most recently
admitted running sequence is preempted: its blocks are released and it waits to be recomputed
(its tokens are kept, so the result is unchanged). A step never fails for want of memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler.kv_manager import KVManager
from scheduler.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this step every token of the sequence has KV: the step samples its next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds blocks (a fork, or a parked one resuming) runs from the next step."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def park(self, seq: Sequence) -> None:
        """Stop scheduling a running sequence but keep its blocks (a search path between steps)."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PARKED

    def finish(self, seq: Sequence) -> None:
        """Remove the sequence from its queue and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.PARKED:
            pass
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                index += 1
                continue
            allocation = self.kv.append_slots(seq, num_new)
            while allocation is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
                allocation = self.kv.append_slots(seq, num_new)
            if allocation is None:
                break  # `seq` itself was preempted; everything after it already was
            out.copies.extend(allocation.copies)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new
            index += 1

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            if not self.kv.admit(seq, budget):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new

        if not out.scheduled and self.waiting and not self.running:
            seq = self.waiting[0]
            raise MemoryError(f"a sequence of {len(seq)} tokens cannot fit in an empty KV pool")
        return out

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
