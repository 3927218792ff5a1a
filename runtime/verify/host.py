"""What the verifiers ask of the engine they score for (their ports); the engine satisfies them.

A reward model's store prefills in its own pool, so it needs the engine only to fail a request it
cannot hold and to report how long a verification took. The judge asks the generator itself, so
its questions are sequences in the engine's own pool: forked, parked and released there.
"""

from __future__ import annotations

from typing import Protocol

from runtime.kv.sequence_host import SequenceHost


class ScoreClient(Protocol):
    """What a scorer asks of the one it scores for (a search's controller, a rewards request): the
    scorer tells it of each score and of each batch on its way, and the client counts them itself."""

    request_id: str
    question: str
    is_finished: bool

    def expect_scores(self) -> None: ...  # a batch of scores is on its way: `score_done` once all arrived

    def on_score(self, path, score: float, prefilled: int = 0, cached: int = 0) -> None: ...

    def score_done(self) -> None: ...

    def lookahead_unit(self, path) -> str | None: ...  # the next step to score with this one, if any

    def on_next_score(self, path, unit: str, score: float) -> None: ...  # that next step's score


class GroundedClient(ScoreClient, Protocol):
    """A client whose prompt grounds a score (the calculator's operands): a search's controller."""

    prompt_ids: list[int]


class VerifierHost(Protocol):
    def fail_request(self, request_id: str, message: str, status: int = 503,
                     code: str = "kv_cache_exhausted") -> None: ...

    def observe_verifier(self, seconds: float) -> None: ...


class JudgeHost(SequenceHost, Protocol):
    """The judge's questions change through the port every room uses; its host keeps each request's
    questions (a question's owner names its request) and releases them when the request ends."""

    def observe_verifier(self, seconds: float) -> None: ...
