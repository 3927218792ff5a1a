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
    window_copies: list[tuple[int, int]] = field(default_factory=list)  # in the sliding layers' cache
    preempted: list[Sequence] = field(default_factory=list)
    released: list[Sequence] = field(default_factory=list)  # parked sequences that gave their blocks up
    # Nothing runs and the next waiting sequence does not fit even in an empty pool: it never will, so
    # its owner is to end it (a result, not an exception: the step goes on for everything else).
    blocked: Sequence | None = None

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
        # Parked sequences (search paths between steps), oldest first. They give up their blocks
        # before any running sequence is preempted, and are recomputed when resumed.
        self.parked: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds blocks (a fork) runs from the next step."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def park(self, seq: Sequence) -> None:
        """Stop scheduling a sequence but keep its blocks (a search path between steps). One that was
        preempted meanwhile is parked without blocks and recomputed when resumed."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.hold(seq)

    def hold(self, seq: Sequence) -> None:
        """Keep a sequence that is not running (parked, or a fresh fork) on the parked list."""
        seq.status = SequenceStatus.PARKED
        self.parked.append(seq)

    def keep(self, seqs: list[Sequence]) -> None:
        """Move these parked sequences to the front of the parked list: they are the last to give
        up their blocks (they run next)."""
        chosen = {s.seq_id for s in seqs}
        self.parked.sort(key=lambda s: s.seq_id not in chosen)  # stable: the rest keep their order

    def resume(self, seq: Sequence) -> None:
        """Run a parked sequence again: at once if it kept its blocks, else through admission (which
        finds its prefix in the cache) as the next waiting sequence."""
        self.parked.remove(seq)
        if seq.block_table:
            self.add_running(seq)
        else:
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove the sequence from its queue and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.PARKED:
            self.parked.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED

    def give_up_blocks(self, seq: Sequence) -> None:
        """Free a sequence's blocks (their KV is lost): a running one waits to be recomputed, a
        parked one is recomputed when resumed."""
        if seq.status is SequenceStatus.RUNNING:
            self._preempt(seq, SchedulerOutput())
        elif seq.block_table:
            self.kv.free(seq)
            seq.num_preemptions += 1

    def schedule(self, token_cap: int | None = None) -> SchedulerOutput:
        """The next step; `token_cap`: fewer tokens than `max_num_batched_tokens` (a search's deadline)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens if token_cap is None else min(self.max_num_batched_tokens, token_cap)

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                index += 1
                continue
            allocation = self.kv.append_slots(seq, num_new)
            while allocation is None:
                if not self._release_parked(out):
                    victim = self.running[-1]
                    self._preempt(victim, out)
                    if victim is seq:
                        break
                allocation = self.kv.append_slots(seq, num_new)
            if allocation is None:
                break  # `seq` itself was preempted; everything after it already was
            out.copies.extend(allocation.copies)
            out.window_copies.extend(allocation.window_copies)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
            index += 1

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            if not self.kv.admit(seq, budget):
                if self.running or not self._release_parked(out):
                    break
                continue  # nothing runs: parked blocks were the only room left
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new

        if not out.scheduled and self.waiting and not self.running:
            out.blocked = self.waiting[0]
        return out

    def _release_parked(self, out: SchedulerOutput) -> bool:
        """Free the blocks of the most recently parked sequence holding any; it stays parked and is
        recomputed (mostly from the prefix cache) when resumed. False if none holds blocks."""
        for seq in reversed(self.parked):
            if seq.block_table:
                self.kv.free(seq)
                seq.num_preemptions += 1
                out.released.append(seq)
                return True
        return False

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
