"""POST /v1/rewards: a client's own responses scored step by step by one of the server's verifiers.

The body names the conversation (`messages`, whose last assistant message may be the response) or a
`prompt`, and the response(s): `response` (cut into steps at `step_delimiter`), `steps`, or `input`, a
list of either. The scoring itself happens in the runtime, with the scorers a search uses
(runtime.verify.rewards); this module only reads the body and writes the answer.
"""

from __future__ import annotations

import time
import uuid
from runtime.wire.protocol import RewardCandidate, Rewarded, RewardRequest
from server.errors import APIError
from server.non_openai_schemas import RewardsBody

# Built-in verifiers a request may name beside the configured reward models; `confidence` and
# `calculator` rank by the log-probabilities of tokens the generator sampled, which given text has none of.
TEXT_VERIFIERS = ("judge",)
SAMPLING_VERIFIERS = ("confidence", "calculator")


def default_verifier(verifiers: tuple[str, ...]) -> str:
    models = [name for name in verifiers if name not in TEXT_VERIFIERS + SAMPLING_VERIFIERS]
    return models[0] if models else "judge"


def reward_request(body: RewardsBody, verifiers: tuple[str, ...], max_n: int, max_steps: int) -> RewardRequest:
    """The runtime's request, or an APIError naming the field at fault. The steps themselves (none,
    blank, too many, too long for the verifier) are checked in the runtime, where they are cut."""
    if (body.messages is None) == (body.prompt is None):
        raise APIError(400, "send exactly one of messages and prompt", "messages")
    verifier = body.verifier if body.verifier is not None else default_verifier(verifiers)
    if verifier not in verifiers:
        raise APIError(400, f"unknown verifier {verifier!r}; this server has {', '.join(verifiers)}", "verifier")
    if verifier in SAMPLING_VERIFIERS:
        raise APIError(400, f"the {verifier} verifier ranks by the log-probabilities of tokens the generator "
                            "sampled, which a given response has none of; name a reward model or judge", "verifier")
    given = [name for name in ("input", "steps", "response") if getattr(body, name) is not None]
    if len(given) > 1:
        raise APIError(400, f"send one of input, steps and response, not {' and '.join(given)}", given[1])
    messages = body.messages
    if body.input is not None:
        if not body.input:
            raise APIError(400, "input holds no response", "input")
        if len(body.input) > max_n:
            raise APIError(400, f"input holds {len(body.input)} responses, over this server's cap of {max_n}", "input")
        candidates = tuple(_candidate(item.steps, item.response, f"input.{i}") for i, item in enumerate(body.input))
    elif given:
        candidates = (_candidate(body.steps, body.response, None),)
    elif messages is not None and messages[-1].role == "assistant":
        candidates = (RewardCandidate(text=messages[-1].text(), param="messages"),)
        messages = messages[:-1]
    else:
        raise APIError(400, "missing response: send response, steps or input, or end messages with the "
                            "assistant's response", "response")
    return RewardRequest(request_id=uuid.uuid4().hex, verifier=verifier, candidates=candidates,
                         messages=tuple(m.wire() for m in messages) if messages is not None else None,
                         prompt=body.prompt, step_delimiter=body.step_delimiter, aggregation=body.aggregation,
                         max_steps=max_steps)


def _candidate(steps: list[str] | None, response: str | None, prefix: str | None) -> RewardCandidate:
    def name(field: str) -> str:
        return f"{prefix}.{field}" if prefix else field

    if (steps is None) == (response is None):
        raise APIError(400, "send exactly one of response and steps", prefix or "response")
    if steps is not None:
        return RewardCandidate(steps=tuple(steps), param=name("steps"))
    return RewardCandidate(text=response, param=name("response"))


def rewards_body(answer: Rewarded, model: str, request: RewardRequest) -> dict:
    return {"id": "rwd-" + request.request_id, "object": "rewards", "created": int(time.time()), "model": model,
            "verifier": request.verifier, "aggregation": request.aggregation,
            "data": [{"object": "reward", "index": i, "steps": list(r.steps), "step_scores": list(r.step_scores),
                      "score": r.score} for i, r in enumerate(answer.rewards)],
            "usage": {"prompt_tokens": answer.input_tokens, "completion_tokens": 0,
                      "total_tokens": answer.input_tokens,
                      "prompt_tokens_details": {"cached_tokens": answer.cached_tokens}}}
