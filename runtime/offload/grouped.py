"""Locality-aware beam scheduling (`lbs`) and its ablation without prefix sharing (`lbs_no_prefix`).

Per search step: the budget is read (what the compute tier can hold now), the beams are grouped
(Algorithm 1 with balanced rounds, `scheduler.grouping.group_beams`), consecutive groups are
ordered to share the most blocks, and each group decodes its whole step while its blocks stay
resident (inter-token locality). While a group runs, the next group's missing blocks are
prefetched into the slots it leaves free.

`lbs`: a compute copy is keyed by the logical block, so a block shared by several beams is
loaded and held once (inter-beam locality), and copies stay resident, least recently used first
out, across groups and steps.

`lbs_no_prefix` follows the paper's ablation (its Eq. 4-5 model of beam scheduling): every beam
has private copies, keyed (beam id, block); a group's beams each load all their blocks, nothing
loaded for one beam serves another, and a group's copies are evicted (dirty ones written back)
when it finishes its step, so each step reloads every beam's KV. Balanced rounds and prefetch
are the same as in `lbs`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from runtime.offload.block_store import BlockStore
from runtime.offload.residency import Key
from runtime.offload.runner import DecodeEntry, OffloadRunner
from runtime.offload.search import Advance, BeamState, StepStats
from scheduler.grouping import Beam, BeamGroup, group_beams, order_groups
from scheduler.kv_manager import KVManager
from scheduler.sequence import Sequence

_ROOT = -1  # owner of the prompt's private copies in lbs_no_prefix


class GroupedPolicy:
    def __init__(self, store: BlockStore, runner: OffloadRunner, kv: KVManager, step_tokens: int,
                 *, share_prefix: bool, budget: Callable[[], int]) -> None:
        self.store = store
        self.runner = runner
        self.kv = kv
        self.step_tokens = step_tokens
        self.share_prefix = share_prefix
        self.budget = budget
        self.block_size = kv.block_size

    def key(self, beam_id: int, block_id: int) -> Key:
        return block_id if self.share_prefix else (beam_id, block_id)

    # ---- the search's calls --------------------------------------------------------------------
    def prefill(self, seq: Sequence) -> torch.Tensor:
        keys = [self.key(_ROOT, b) for b in seq.block_table]
        for k in keys:
            self.store.create(k, set(keys))
        logits = self.runner.prefill(self.store.cache, seq.token_ids,
                                     [self.store.slot(k) for k in keys])
        self.store.release(keys, drop=not self.share_prefix)
        return logits

    def copy_block(self, src: int, dst: int, beam: BeamState) -> None:
        src_key = self.key(beam.beam_id, src)
        self.store.copy(src_key, self.key(beam.beam_id, dst))
        if not self.share_prefix:
            self.store.drop([src_key])

    def forget(self, block_ids: Iterable[int]) -> None:
        self.store.forget(block_ids)

    def run_step(self, beams: list[BeamState], advance: Advance) -> StepStats:
        budget = self.budget()
        self.store.set_limit(budget)
        by_id = {b.beam_id: b for b in beams}
        plans = [self._plan(b) for b in beams]
        groups = group_beams(plans, budget, share_prefix=self.share_prefix)
        if groups is None:
            raise MemoryError(f"a beam needs more than the {budget} blocks the compute tier has")
        groups = order_groups(groups, resident=self.store.residency.held_keys())
        for i, group in enumerate(groups):
            following = groups[i + 1] if i + 1 < len(groups) else None
            self._run_group([by_id[j] for j in group.beam_ids], group, following, advance)
        return StepStats(tuple(len(g.beam_ids) for g in groups),
                         tuple(g.num_blocks for g in groups), budget)

    # ---- internals -----------------------------------------------------------------------------
    def _plan(self, beam: BeamState) -> Beam:
        """The blocks a beam reads this step (those holding computed tokens) and how many fresh
        blocks its step writes."""
        num_read = -(-beam.seq.num_computed_tokens // self.block_size)
        table = beam.seq.block_table
        return Beam(beam.beam_id, tuple(self.key(beam.beam_id, b) for b in table[:num_read]),
                    len(table) - num_read)

    def _run_group(self, members: list[BeamState], group: BeamGroup, following: BeamGroup | None,
                   advance: Advance) -> None:
        store, bs = self.store, self.block_size
        reads = list(group.block_ids)
        fresh: list[Key] = []
        partial: list[Key] = []  # read blocks this step also appends to
        for beam in members:
            seq = beam.seq
            num_read = -(-seq.num_computed_tokens // bs)
            fresh += [self.key(beam.beam_id, b) for b in seq.block_table[num_read:]]
            if seq.num_computed_tokens % bs:
                partial.append(self.key(beam.beam_id, seq.block_table[num_read - 1]))
        protect = set(reads) | set(fresh)
        store.acquire(reads, protect)
        for k in fresh:
            store.create(k, protect)
        store.mark_written(partial)
        if following is not None:
            upcoming = list(following.block_ids)
            store.prefetch(upcoming, protect | set(upcoming))
        for _ in range(self.step_tokens):
            entries = []
            for beam in members:
                seq = beam.seq
                position = seq.num_computed_tokens
                table = seq.block_table[:position // bs + 1]
                entries.append(DecodeEntry(seq.token_ids[-1], position,
                                           tuple(store.slot(self.key(beam.beam_id, b)) for b in table)))
            advance(members, self.runner.decode(store.cache, entries))
        store.release(reads + fresh, drop=not self.share_prefix)
