"""What a search reads of the engine it runs on (its port); the engine satisfies it.

Only reads: the tokenizer facts and limits it decodes within, what a step's tokens will take in
blocks (counted, never touched) and whether a slot is idle. Whatever it wants changed (forks,
releases, parks, resumes, a step's groups, messages) it asks for in its plan
(`runtime.search.plan`), which the step's work carries out through the engine (`runtime.steps`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from scheduler.kv_manager import KVManager

if TYPE_CHECKING:
    import torch


class Verifier(Protocol):
    """What a search asks of the verifier it was given (runtime.verify's scorers satisfy it). A free
    one scores in `submit` itself; another one's scores arrive in later steps, asked for in the plan
    (`Verify`), each batch announced to the search (`expect_scores`) and ended by `score_done`."""

    name: str
    is_free: bool  # scores at once from what the search has: still taken past its deadline

    def submit(self, client, paths) -> None: ...

    def score_of(self, logprobs: list[float]) -> float | None: ...  # a unit's score from these alone, None: not so

    def outranks(self, score: float, anchor_score: float) -> bool: ...  # the greedy anchor's margin


class SearchLimits(Protocol):
    @property
    def max_model_len(self) -> int: ...

    @property
    def speculative_extension(self) -> bool | str: ...


class SearchHost(Protocol):
    @property
    def config(self) -> SearchLimits: ...

    @property
    def tokenizer(self): ...

    @property
    def eos_ids(self) -> frozenset[int]: ...

    @property
    def device(self) -> "torch.device": ...

    @property
    def kv(self) -> KVManager: ...  # for block counts: what a step's tokens will take

    def has_idle_slot(self) -> bool: ...  # whether speculative rows may go on

    def num_idle_slots(self) -> int: ...  # how many more may start

    def speculative_row_cap(self, num_speculative: int) -> int | None: ...  # the most that pay (the step-cost model), None: all

    def observe_speculation(self, saved: int, speculated: int) -> None: ...  # decode steps saved by tokens decoded
