"""A plain decode step's inputs in Python lists: every entry one generated token, read by the decode
attention kernel. `ModelRunner._prepare` builds any step's tensors with a fixed number of tensor
operations (about 25, 0.3-0.5 ms on a CPU: a twentieth of a one-stream step of a SmolLM2-sized model);
a step of decode tokens alone needs only its tokens, positions, slots and block tables, the same values
`_prepare` computes for it, so the same step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.scheduler import ScheduledSequence


@dataclass
class PlainDecode:
    token_ids: list[int]  # each entry's new token
    positions: list[int]  # its position (the tokens computed before it)
    slot_blocks: list[int]  # the block its key and value go to
    slot_offsets: list[int]  # and the offset in it
    tables: list[list[int]]  # each entry's block table, as wide as the longest context's (padded past its own)
    ctx: list[int]  # each entry's context, itself included


def plain_decode(scheduled: Sequence[ScheduledSequence], block_size: int, exact_prefill: bool) -> PlainDecode | None:
    """The step as `PlainDecode`, or None where it is not one: an entry with more than one new token,
    or one still in its prompt (a prompt's last tokens are prefilled unless `exact_prefill`)."""
    token_ids, positions = [], []
    for entry in scheduled:
        seq = entry.seq
        start = seq.num_computed_tokens
        if entry.num_new_tokens != 1 or not (exact_prefill or start >= seq.num_prompt_tokens):
            return None
        token_ids.append(seq.token_ids[start])
        positions.append(start)
    if not positions:
        return None
    width = max(positions) // block_size + 1  # blocks of the longest context
    tables, slot_blocks = [], []
    for entry, position in zip(scheduled, positions):
        table = entry.seq.block_table
        slot_blocks.append(table[position // block_size])
        row = list(table[:width])
        tables.append(row + [row[-1]] * (width - len(row)))  # (past the context: never read)
    return PlainDecode(token_ids, positions, slot_blocks, [p % block_size for p in positions], tables,
                       [p + 1 for p in positions])
