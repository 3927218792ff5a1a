"""Locality-aware beam scheduling of a search step over the engine's compute pool.

A search step's paths are planned into groups (`scheduler.grouping`) that fit the blocks the
compute pool can give this search now; the controller runs one group's whole step while it is
resident, then the next. A path is seen as the chained hashes of its full blocks (the same name
in every tier, so blocks shared by forked paths or found in the prefix cache count once) plus the
blocks its step will write (its partial last block is copied on first write, so it is its own).

Policies (`[scheduler] policy`):
    lbs            Algorithm 1 groups by shared blocks, balanced rounds, consecutive groups
                   ordered to share the most blocks (FlashTTS), the next group's blocks prefetched
    lbs_no_prefix  the ablation: the same rounds, beams in order, every beam charged for all
                   its blocks as if nothing were shared
    token          no groups: every path advances token by token together; what does not fit is
                   released and readmitted sequence by sequence by the scheduler

Whatever the groups, each path decodes its own tokens from its own KV and sampler, so the
tokens do not depend on the policy or the budget.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from runtime.kv.host import PlannerHost
from scheduler.grouping import Beam, group_beams, order_groups
from scheduler.sequence import Sequence
from storage.block_hash import hash_blocks

POLICIES = ("lbs", "lbs_no_prefix", "token")


class StepPlanner:
    def __init__(self, host: PlannerHost, policy: str, max_num_seqs: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduler policy {policy!r}; one of {', '.join(POLICIES)}")
        self.host = host
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.num_groups = 0  # groups planned so far (a step with one group counts one)
        self.num_prefetched = 0  # blocks brought up from a lower tier ahead of their group

    def block_keys(self, seq: Sequence) -> list:
        """Names of the full blocks whose KV the path has computed, prefix first."""
        kv = self.host.kv
        block_size = kv.block_size
        num_full = max(0, len(seq.token_ids) - 1) // block_size
        if len(seq.block_hashes) >= num_full:
            return list(seq.block_hashes[:num_full])
        if kv.enable_prefix_cache:
            return hash_blocks(seq.token_ids[:num_full * block_size], block_size, kv.extra_key)
        if len(seq.block_table) >= num_full:  # no names: physical ids still show what forks share
            return [("block", b) for b in seq.block_table[:num_full]]
        return [("path", seq.seq_id, i) for i in range(num_full)]

    def budget(self, mine: Seq[Sequence]) -> tuple[int, int]:
        """(blocks, sequences) this search may use now: the pool less what other requests hold,
        and the batch less what other requests run."""
        ids = {s.seq_id for s in mine}
        scheduler = self.host.scheduler
        held: set[int] = set()
        for seq in scheduler.running + scheduler.parked:
            if seq.seq_id not in ids:
                held.update(seq.block_table)
        others_running = sum(1 for s in scheduler.running if s.seq_id not in ids)
        max_seqs = self.max_num_seqs - others_running
        caps = self.host.kv_caps  # the roofline split's decode batch for the load now
        if caps is not None:
            max_seqs = min(max_seqs, caps.decode_batch)
        return self.host.pool.num_blocks - len(held), max(1, max_seqs)

    def plan(self, seqs: Seq[Sequence], step_tokens: Seq[int]) -> list[list[int]]:
        """Indices into `seqs`, one list per group, in execution order."""
        if not seqs:
            return []
        if self.policy == "token" or len(seqs) == 1:
            self.num_groups += 1
            return [list(range(len(seqs)))]
        kv = self.host.kv
        beams = []
        for i, (seq, tokens) in enumerate(zip(seqs, step_tokens)):
            keys = self.block_keys(seq)
            beams.append(Beam(i, keys, max(0, kv.num_blocks_for(len(seq.token_ids) + tokens) - len(keys))))
        budget_blocks, max_beams = self.budget(seqs)
        groups = group_beams(beams, budget_blocks, share_prefix=self.policy == "lbs", max_beams=max_beams)
        if groups is None:  # one path alone outgrows what is free: the scheduler's preemption copes
            self.num_groups += 1
            return [list(range(len(seqs)))]
        if self.policy == "lbs":
            running = self.host.scheduler.running
            groups = order_groups(groups, resident=[k for s in running for k in self.block_keys(s)])
        self.num_groups += len(groups)
        return [list(g.beam_ids) for g in groups]

    def prefetch(self, seqs: Seq[Sequence], reserve: int) -> int:
        """Prepare the next group: its parked sequences keep their blocks longest (the scheduler takes
        others' first), and those of its blocks that live in a lower tier come into the compute pool
        (as cached blocks, which its admission then finds), leaving `reserve` free blocks for the
        running group. Returns the blocks brought up."""
        self.host.scheduler.keep(seqs)
        residency = self.host.residency
        if residency is None or self.policy == "token":
            return 0
        moved = 0
        for seq in seqs:
            room = self.host.pool.num_free - reserve
            if room <= 0:
                break
            if not seq.block_table:
                moved += residency.promote_prefix(seq, limit=room)
        self.num_prefetched += moved
        return moved
