"""Step-wise beam search over logical blocks, independent of where the blocks live.

The prompt is prefilled once; `num_beams` beams fork from it (sharing its blocks) and each samples
its own first token. A search step lets every beam decode `step_tokens` tokens; then the
`num_beams // beam_width` best beams by score (cumulative log-probability of their sampled
tokens, ties to the lower beam id) are kept and each forks `beam_width` children that share its
blocks (copy-on-write through `KVManager`). The last step keeps every beam.

How a step runs (which beams decode together, which blocks are resident, what moves between
tiers) is the policy's business; the search only says what must be computed. Every beam samples
from its own generator, seeded from the request seed and its place in the tree, so the tokens do
not depend on the policy, the budget or the order in which beams run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import torch

from runtime.protocol import SamplingParams
from runtime.sampler import SamplingState, derive_seed, sample
from scheduler.kv_manager import KVManager
from scheduler.sequence import Sequence


@dataclass(frozen=True)
class SearchSpec:
    prompt_ids: tuple[int, ...]
    num_beams: int = 16
    beam_width: int = 2  # children per kept beam
    step_tokens: int = 32
    num_steps: int = 8
    seed: int = 0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        if not self.prompt_ids or self.num_beams < 1 or self.step_tokens < 1 or self.num_steps < 1:
            raise ValueError("a search needs a prompt, a beam, a step token and a step")
        if self.beam_width < 1 or self.num_beams % self.beam_width:
            raise ValueError(f"num_beams {self.num_beams} is not a multiple of beam_width "
                             f"{self.beam_width}")
        if self.temperature <= 0:
            raise ValueError("the search samples: temperature must be > 0")

    @property
    def num_kept(self) -> int:
        return self.num_beams // self.beam_width

    @property
    def num_computed_tokens(self) -> int:
        """Tokens with KV in each final beam (its last sampled token is never computed)."""
        return len(self.prompt_ids) + self.step_tokens * self.num_steps

    def num_logical_blocks(self, block_size: int) -> int:
        """Logical blocks that always suffice: the prompt plus every beam unshared, and a block
        per beam of slack for copy-on-write."""
        per_beam = -(-self.num_computed_tokens // block_size)
        return -(-len(self.prompt_ids) // block_size) + self.num_beams * (per_beam + 1)


@dataclass
class BeamState:
    beam_id: int
    seq: Sequence
    sampling: SamplingState
    score: float = 0.0


@dataclass(frozen=True)
class StepStats:
    group_sizes: tuple[int, ...]  # beams per group, in execution order
    group_blocks: tuple[int, ...]  # blocks each group was charged
    budget_blocks: int

    @property
    def num_groups(self) -> int:
        return len(self.group_sizes)


Advance = Callable[[Seq[BeamState], torch.Tensor], None]


class Policy(Protocol):
    def prefill(self, seq: Sequence) -> torch.Tensor: ...
    def copy_block(self, src: int, dst: int, beam: BeamState) -> None: ...
    def run_step(self, beams: list[BeamState], advance: Advance) -> StepStats: ...
    def forget(self, block_ids: Iterable[int]) -> None: ...


@dataclass
class SearchResult:
    tokens: list[tuple[int, ...]]  # generated tokens of every final beam
    scores: list[float]
    steps: list[StepStats] = field(default_factory=list)


class BeamSearch:
    def __init__(self, spec: SearchSpec, kv: KVManager, policy: Policy, device: torch.device) -> None:
        self.spec = spec
        self.kv = kv
        self.policy = policy
        self.device = device
        self.params = SamplingParams(temperature=spec.temperature, logprobs=True)
        self._ids = itertools.count()
        self.beams: list[BeamState] = []  # the live beams (after `run`, the final ones)

    def run(self) -> SearchResult:
        spec = self.spec
        root = Sequence(list(spec.prompt_ids))
        if not self.kv.admit(root, len(root)):
            raise MemoryError("the logical block pool cannot hold the prompt")
        logits = self.policy.prefill(root)
        self.kv.commit_computed(root, len(root))
        beams = [self._child(root, 0, i, 0.0) for i in range(spec.num_beams)]
        self.kv.free(root)  # the beams hold its blocks now
        self._sample(beams, logits.expand(len(beams), -1))
        result = SearchResult([], [])
        for step in range(spec.num_steps):
            for beam in beams:
                allocation = self.kv.append_slots(beam.seq, spec.step_tokens)
                if allocation is None:
                    raise MemoryError("the logical block pool is exhausted")
                for src, dst in allocation.copies:
                    self.policy.copy_block(src, dst, beam)
            result.steps.append(self.policy.run_step(beams, self.advance))
            if step + 1 < spec.num_steps:
                beams = self._select(beams, step + 1)
        self.beams = beams
        result.tokens = [tuple(b.seq.output_token_ids) for b in beams]
        result.scores = [b.score for b in beams]
        return result

    def advance(self, beams: Seq[BeamState], logits: torch.Tensor) -> None:
        """The forward that gave `logits` (a row per beam) wrote the KV of each beam's last token:
        record it, then sample each beam's next token."""
        for beam in beams:
            self.kv.commit_computed(beam.seq, beam.seq.num_computed_tokens + 1)
        self._sample(beams, logits)

    def _sample(self, beams: Seq[BeamState], logits: torch.Tensor) -> None:
        outs = sample(logits, [b.sampling for b in beams], [([], [])] * len(beams))
        for beam, out in zip(beams, outs):
            beam.seq.append_token(out.token_id)
            beam.score += out.logprob

    def _child(self, parent: Sequence, depth: int, index: int, score: float) -> BeamState:
        seq = Sequence(parent.token_ids, len(self.spec.prompt_ids))
        self.kv.fork(parent, seq)
        state = SamplingState(self.params, derive_seed(self.spec.seed, depth, index), self.device)
        return BeamState(next(self._ids), seq, state, score)

    def _select(self, beams: list[BeamState], depth: int) -> list[BeamState]:
        ranked = sorted(beams, key=lambda b: (-b.score, b.beam_id))
        width = self.spec.beam_width
        children = [self._child(parent.seq, depth, rank * width + c, parent.score)
                    for rank, parent in enumerate(ranked[:self.spec.num_kept]) for c in range(width)]
        held = {b for beam in beams for b in beam.seq.block_table}
        for beam in beams:
            self.kv.free(beam.seq)
        self.policy.forget(sorted(b for b in held if self.kv.pool.ref_counts[b] == 0))
        return children
