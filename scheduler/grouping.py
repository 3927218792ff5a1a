"""Which beams decode together, in what order, within a compute-tier budget counted in blocks.

Locality-aware beam scheduling: a step's beams run in groups whose KV blocks all fit in the
compute tier at once, each group finishing its step before the next is loaded (inter-token
locality). Beams sharing blocks go to the same group, where a shared block is resident, and
charged, once (inter-beam locality). Groups are balanced: the round count is the minimum the
budget allows, and beams are spread evenly over those rounds, so the smaller groups leave
headroom to prefetch the next group's blocks.

Pure bookkeeping over block ids or block hashes (any hashable; equal keys name one block);
results are small frozen values, never tensors.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

BlockKey = Hashable


@dataclass(frozen=True)
class Beam:
    """A beam as the scheduler sees it: the blocks it reads, prefix first, and the blocks its step
    will allocate for new tokens (never shared)."""
    beam_id: int
    block_ids: tuple[BlockKey, ...]
    num_new_blocks: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", tuple(self.block_ids))
        if self.num_new_blocks < 0:
            raise ValueError(f"beam {self.beam_id}: num_new_blocks must be >= 0")

    @property
    def num_blocks(self) -> int:
        """Compute blocks this beam needs alone."""
        return len(set(self.block_ids)) + self.num_new_blocks


@dataclass(frozen=True)
class BeamGroup:
    """Beams that run together; `block_ids` are the distinct blocks they read (first-seen order),
    `num_blocks` what the group is charged: its blocks (shared ones once, or once per beam when
    sharing is ignored) plus the new blocks of its beams."""
    beam_ids: tuple[int, ...]
    block_ids: tuple[BlockKey, ...]
    num_blocks: int


@dataclass(frozen=True)
class RoundPlan:
    max_beams_per_round: int
    num_rounds: int


def round_plan(num_beams: int, max_beam_blocks: int, budget_blocks: int) -> RoundPlan | None:
    """B = min(N, budget // largest beam) beams per round and ceil(N / B) rounds; None if one beam
    alone exceeds the budget."""
    if max_beam_blocks > budget_blocks:
        return None
    if num_beams == 0:
        return RoundPlan(0, 0)
    if max_beam_blocks == 0:
        return RoundPlan(num_beams, 1)
    per_round = min(num_beams, budget_blocks // max_beam_blocks)
    return RoundPlan(per_round, math.ceil(num_beams / per_round))


def balanced_sizes(num_beams: int, num_rounds: int) -> tuple[int, ...]:
    """Beams per round as even as possible, smaller rounds first: (16, 3) -> (5, 5, 6).

    Smaller first because the headroom a round leaves is used to prefetch the next one, and the
    last round of a step has no next round to prefetch for.
    """
    if num_rounds <= 0:
        return ()
    base, extra = divmod(num_beams, num_rounds)
    return (base,) * (num_rounds - extra) + (base + 1,) * extra


def greedy_groups(beams: Sequence[Beam], budget_blocks: int,
                  sizes: Sequence[int] | None = None) -> tuple[BeamGroup, ...] | None:
    """Algorithm 1: fill each group with the beam sharing the most blocks with it, while it fits.

    A group's cost counts each distinct block once, plus its beams' new blocks. Each group is
    seeded with the unplaced beam sharing the most blocks with the previous group, so consecutive
    groups are neighbours in the prefix tree (FlashTTS's prefix-aware order). Ties go to the
    earlier beam in `beams`. A beam whose best-sharing choice would not fit is passed over for
    the best one that does. With `sizes`, group k takes at most sizes[k] beams and None is
    returned if beams are left after len(sizes) groups; None too if one beam exceeds the budget.
    """
    block_sets = [set(b.block_ids) for b in beams]
    if any(b.num_blocks > budget_blocks for b in beams):
        return None
    holders: dict[BlockKey, list[int]] = {}
    for i, blocks in enumerate(block_sets):
        for block in blocks:
            holders.setdefault(block, []).append(i)
    unplaced = list(range(len(beams)))
    groups: list[BeamGroup] = []
    previous: set[BlockKey] = set()
    while unplaced:
        if sizes is not None and len(groups) == len(sizes):
            return None
        limit = sizes[len(groups)] if sizes is not None else len(beams)
        members: list[int] = []
        union: set[BlockKey] = set()
        num_new = 0
        overlap = dict.fromkeys(unplaced, 0)  # blocks each unplaced beam shares with the group
        seed_score = {i: len(block_sets[i] & previous) for i in unplaced}
        while len(members) < limit and unplaced:
            room = budget_blocks - len(union) - num_new
            fitting = [i for i in unplaced
                       if len(block_sets[i]) - overlap[i] + beams[i].num_new_blocks <= room]
            if not fitting:
                break
            score = overlap if members else seed_score
            best = max(fitting, key=lambda i: (score[i], -i))
            members.append(best)
            unplaced.remove(best)
            del overlap[best]
            num_new += beams[best].num_new_blocks
            for block in block_sets[best] - union:
                union.add(block)
                for j in holders[block]:
                    if j in overlap:
                        overlap[j] += 1
        groups.append(_shared_group([beams[i] for i in members]))
        previous = union
    return tuple(groups)


def group_beams(beams: Iterable[Beam], budget_blocks: int, *, share_prefix: bool = True,
                max_beams: int | None = None) -> tuple[BeamGroup, ...] | None:
    """The step's groups in execution order; None if one beam alone exceeds the budget.

    share_prefix=True (LBS): the round count is what Algorithm 1 needs when packing to the budget
    with shared blocks counted once (never more than round_plan's); the beams are then regrouped
    by Algorithm 1 into balanced_sizes over that many rounds. If sharing made the packed groups
    larger than balanced groups can hold within the budget, the packed groups are kept.

    share_prefix=False (the lbs_no_prefix ablation): round_plan's rounds and balanced_sizes,
    beams in input order, each beam charged for all its blocks as if nothing were shared.

    `max_beams` caps a group's beams (the sequences a step may batch), adding rounds if needed.
    """
    beams = list(beams)
    if len({b.beam_id for b in beams}) != len(beams):
        raise ValueError("beam ids must be unique")
    if max_beams is not None and max_beams < 1:
        raise ValueError("max_beams must be >= 1")
    cap_rounds = math.ceil(len(beams) / max_beams) if max_beams else 0
    if not share_prefix:
        plan = round_plan(len(beams), max((b.num_blocks for b in beams), default=0), budget_blocks)
        if plan is None:
            return None
        groups, start = [], 0
        for size in balanced_sizes(len(beams), max(plan.num_rounds, cap_rounds)):
            members = beams[start:start + size]
            start += size
            groups.append(BeamGroup(tuple(b.beam_id for b in members), _distinct(members),
                                    sum(b.num_blocks for b in members)))
        return tuple(groups)
    packed = greedy_groups(beams, budget_blocks, [max_beams] * len(beams) if max_beams else None)
    if packed is None:
        return None
    balanced = greedy_groups(beams, budget_blocks, balanced_sizes(len(beams), max(len(packed), cap_rounds)))
    return balanced if balanced is not None else packed


def order_groups(groups: Sequence[BeamGroup],
                 resident: Iterable[BlockKey] = ()) -> tuple[BeamGroup, ...]:
    """Groups reordered so each shares the most blocks with the one before it (FlashTTS order).

    The first is the group sharing the most with `resident` (the blocks already in the compute
    tier, e.g. the previous step's last group); ties keep the given order.
    """
    remaining = list(groups)
    ordered: list[BeamGroup] = []
    last = set(resident)
    while remaining:
        best = max(range(len(remaining)),
                   key=lambda k: (len(last.intersection(remaining[k].block_ids)), -k))
        group = remaining.pop(best)
        ordered.append(group)
        last = set(group.block_ids)
    return tuple(ordered)


def prefetch_blocks(current: BeamGroup, next_group: BeamGroup,
                    budget_blocks: int) -> tuple[BlockKey, ...]:
    """Blocks of `next_group` not resident for `current`, in next_group's order, as many as fit in
    the headroom `budget_blocks - current.num_blocks` while `current` runs."""
    resident = set(current.block_ids)
    missing = [b for b in next_group.block_ids if b not in resident]
    return tuple(missing[:max(0, budget_blocks - current.num_blocks)])


def _distinct(members: Sequence[Beam]) -> tuple[BlockKey, ...]:
    return tuple(dict.fromkeys(b for beam in members for b in beam.block_ids))


def _shared_group(members: Sequence[Beam]) -> BeamGroup:
    blocks = _distinct(members)
    return BeamGroup(tuple(b.beam_id for b in members), blocks,
                     len(blocks) + sum(b.num_new_blocks for b in members))
