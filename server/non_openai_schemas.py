"""Request bodies of the endpoints beside OpenAI's: vLLM's /tokenize and /detokenize, and ponder's
/v1/rewards (server.rewards).

Apart from the OpenAI endpoints' bodies (server.schemas) because none of them generates: they share
the message shape and the wire checks (`Body`, server.bodies) and the template's kwargs.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from runtime.wire.params import SearchParams
from server.bodies import Body, ChatMessage
from server.schemas import TemplateKwargs


class TokenizeBody(Body):
    """vLLM's /tokenize: a prompt, or messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (as vLLM)
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs | None = None  # as on chat completions, over the server's defaults

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self

    def wire_messages(self) -> tuple[dict[str, Any], ...] | None:
        if self.messages is None:
            return None
        return tuple(m.wire() for m in self.messages)


class DetokenizeBody(Body):
    model: str | None = None
    tokens: list[int]


class RewardInput(Body):
    """One response of a batch: its text, or its steps."""

    response: str | None = None
    steps: list[str] | None = None


class RewardsBody(Body):
    """POST /v1/rewards (server.rewards): the question, and the response(s) to score step by step."""

    model: str | None = None
    verifier: str | None = None  # None: the first configured reward model, else the judge
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    prompt: str | None = None
    response: str | None = None
    steps: list[str] | None = None
    input: list[RewardInput] | None = None
    step_delimiter: str = Field(SearchParams().step_delimiter, min_length=1)
    aggregation: Literal["last", "min", "prod", "mean"] = "last"
