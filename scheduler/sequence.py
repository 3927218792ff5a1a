"""A sequence: one path of tokens and the block table that holds its KV.

The sequence owns its block table and its token list; the block pool owns the blocks; the
scheduler owns the queues the sequence sits in.
"""

from __future__ import annotations

import enum
import itertools

from storage.block_hash import BlockHash

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"  # holds its blocks but is not scheduled
    FINISHED = "finished"


class Sequence:
    def __init__(self, token_ids: list[int], num_prompt_tokens: int | None = None,
                 arrival: float = 0.0, owner: object = None) -> None:
        self.seq_id = next(_ids)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.block_table: list[int] = []
        # The sliding layers' blocks where they are kept apart (scheduler.sliding_window): one entry per
        # entry of `block_table`, None once the block left the window.
        self.window_table: list[int | None] = []
        # Names of the leading full blocks whose KV has been written and registered.
        self.block_hashes: list[BlockHash] = []
        self.status = SequenceStatus.WAITING
        self.arrival = arrival
        self.num_preemptions = 0
        self.owner = owner  # opaque to the scheduler: the runtime's per-sequence state

    def __len__(self) -> int:
        return len(self.token_ids)

    def own(self, owner: object) -> None:
        """Its owner, named once the owner exists (an owner made around a sequence already forked)."""
        self.owner = owner

    def recompute(self) -> None:
        """Count none of its tokens as computed: their KV is to be written again from the first."""
        self.num_computed_tokens = 0

    def computed(self, tokens: int) -> None:
        """`tokens` more of its tokens have their KV written."""
        self.num_computed_tokens += tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, len={len(self.token_ids)}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
