"""How a search's paths are made: their uids, seed keys and samplers (the grammar's constraint, a
thinking model's phases), so that a speculative branch decoding a child before the child exists
draws the very state the child will (`child_sampling`). It owns the next uid."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.grammar.matcher import Grammar
from runtime.grammar.thinking import ThinkingStart
from runtime.model.sampler import SamplingState, derive_seed
from runtime.search.anchor import ANCHOR_UID, anchor_params
from runtime.search.paths import PathEvents, SearchPath
from runtime.wire.params import SamplingParams, SearchParams
from scheduler.sequence import Sequence

if TYPE_CHECKING:
    import torch


class PathMaker:
    def __init__(self, events: PathEvents, params: SamplingParams, search: SearchParams, prompt_len: int,
                 device: "torch.device", confidence_k: int, grammar: Grammar | None,
                 thinking: ThinkingStart | None) -> None:
        self.events = events
        self.params = params
        self.search = search
        self.prompt_len = prompt_len
        self.device = device
        self.confidence_k = confidence_k
        self.grammar = grammar
        self.thinking = thinking
        self.next_uid = 0

    def first(self, seq: Sequence, subtree: int, *, anchor: bool = False) -> SearchPath:
        """An initial path on `seq` (the prompt forked), or the greedy anchor beside them."""
        uid = ANCHOR_UID if anchor else self._uid()
        constraint = self.grammar.start() if self.grammar is not None else None
        if self.thinking is not None:
            constraint = self.thinking.constraint(constraint, self.params.thinking_token_budget)
        sampling = SamplingState(anchor_params(self.params) if anchor else self.params,
                                 derive_seed(self.params.seed, uid), self.device, track_logprobs=True,
                                 confidence_k=self.confidence_k, constraint=constraint)
        start = len(seq.token_ids)
        return self._made(SearchPath(self.events, uid, subtree, seq, sampling, self.search.aggregation,
                                     step_start=start, step_end=start, chunk_start=start, seed_key=(uid,)))

    def child(self, seq: Sequence, parent: SearchPath, ordinal: int, sampling: SamplingState | None = None,
              step_text=None) -> SearchPath:
        """`parent`'s `ordinal`-th new child forked at its step's end, with its verified units and scores
        (with `sampling` and `step_text`: the state a speculative branch decoded it with)."""
        start = parent.step_end
        return self._made(SearchPath(
            self.events, self._uid(), parent.subtree, seq, sampling or self.child_sampling(parent, ordinal),
            self.search.aggregation, step_start=start, step_end=start, chunk_start=parent.chunk_start,
            chunks=list(parent.chunks), step_scores=list(parent.step_scores), text=parent.text,
            step_text=step_text, node=parent.node,  # its first step's node hangs under the parent's last one
            seed_key=parent.child_seed_key(ordinal)))

    def child_sampling(self, parent, ordinal: int, at: int | None = None) -> SamplingState:
        """The sampler of `parent`'s `ordinal`-th new child at token index `at` (default: its step's
        end): its seed, and its grammar forked there (a speculative branch decoding the child before it
        exists gets this very state; `parent` may be such a branch itself)."""
        at = parent.step_end if at is None else at
        constraint = parent.sampling.constraint  # forked at `at`: not its tokens past it
        return SamplingState(self.params, derive_seed(self.params.seed, *parent.child_seed_key(ordinal, at)),
                             self.device, track_logprobs=True, confidence_k=self.confidence_k,
                             constraint=None if constraint is None else constraint.fork(at - self.prompt_len))

    def _uid(self) -> int:
        self.next_uid += 1
        return self.next_uid - 1

    @staticmethod
    def _made(path: SearchPath) -> SearchPath:
        path.seq.own(path)
        return path
