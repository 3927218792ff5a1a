"""The parameters a request carries across the wire: how to sample, how to search, what every token
of the output must keep matching, and which tools the model may call.

Apart from the messages (runtime.wire.protocol), which carry them, because most of their readers need
only these: the sampler, the search, the grammar compiler and the server's request bodies. Like the
protocol, the module imports nothing of ours and no torch, so the server may import it.
"""

from __future__ import annotations

from typing import Any

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int | None = None  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    # The prompt comes back: its text on each choice's first Delta (`prompt_text`), for /v1/completions' echo.
    echo: bool = False
    # k: each prompt token's log-probability given the tokens before it, with the k most likely tokens
    # there (`prompt_logprobs` on each choice's first Delta). None: not computed (no cost).
    prompt_logprobs: int | None = None
    # OpenAI's logit_bias: (token id, bias added to its logit before sampling), bias in [-100, 100].
    logit_bias: tuple[tuple[int, float], ...] = ()
    # A thinking model's most thinking tokens (runtime.grammar.thinking): then its closing text is forced.
    thinking_token_budget: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0


class SearchParams(msgspec.Struct, frozen=True, kw_only=True):
    strategy: str = "beam"
    n: int = 8
    beam_width: int = 4
    max_steps: int = 40
    step_delimiter: str = "\n\n"
    max_step_tokens: int = 256
    granularity: int = 1
    lookahead: int = 0
    verifier: str = "calculator"
    aggregation: str = "last"
    select: str = "best"
    answer_pattern: str | None = None
    include_events: bool = False
    include_tree: bool = False  # send the search tree as it grows (SearchTree messages)
    timeout_s: float | None = None  # past this, running steps end at their next token and the best path answers
    # One more path decoded at temperature 0; the answer unless a candidate outranks it (runtime.search.anchor).
    greedy_anchor: bool = True
    # DeepConf (strategy "deepconf", runtime.search.strategies.DeepConf): traces run to their end first,
    # None: max(1, n // 4); the percentage of traces whose confidence the stopping threshold keeps (10:
    # DeepConf-low, 90: DeepConf-high); the tokens of a group confidence; vote only the top eta %.
    deepconf_warmup: int | None = None
    deepconf_eta: float = 10.0
    deepconf_window: int = 256
    deepconf_keep_top: bool = False


class Constraint(msgspec.Struct, frozen=True, kw_only=True):
    """What every token of the output must keep matching (runtime.grammar compiles it). kind: json_object
    | json_schema | regex | choice | grammar; `spec` is the schema as JSON text, the regex, the choices as
    a JSON list, or the grammar (Lark or GBNF); `param` is the request field it came from, named in the 400
    when it does not compile."""

    kind: str
    spec: str = ""
    param: str = "response_format"


class ToolCalling(msgspec.Struct, frozen=True, kw_only=True):
    """The request's tools as OpenAI defines them, and how the model may call them.

    choice: auto (the model chooses; a call it starts is constrained to a valid call), required (at
    least one call), function (the one named by `name`); tool_choice none sends no ToolCalling."""

    tools: tuple[dict[str, Any], ...]
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True
