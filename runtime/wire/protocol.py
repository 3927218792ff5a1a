"""The wire between the HTTP process and the runtime process.

Only these message types cross the process boundary, encoded with msgpack (msgspec): token ids,
parameters, text deltas, finish reasons, scores and statistics. Never tensors, block objects or
config objects. The parameters a request carries are in runtime.wire.params. The module imports
nothing of ours outside runtime.wire and no torch, so the server may import it.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from runtime.wire.params import Constraint, SamplingParams, SearchParams, ToolCalling

# ---------------------------------------------------------------------------------------------
# Server -> runtime


class GenerateRequest(msgspec.Struct, frozen=True, tag=True, tag_field="msg", kw_only=True):
    request_id: str
    endpoint: str  # "chat" | "completion"
    # Exactly one of these is set: chat messages (rendered with the chat template in the runtime),
    # a prompt text, or prompt token ids.
    # A message is OpenAI's: role and content, and an assistant's `tool_calls` or a tool's `tool_call_id`.
    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = SamplingParams()
    search: SearchParams | None = None
    constraint: Constraint | None = None  # response_format, structured_outputs
    tools: ToolCalling | None = None
    # Chat: variables for the template beside the messages (`enable_thinking`), the server's defaults
    # under the request's own.
    chat_template_kwargs: dict[str, Any] = {}


# transformers' apply_chat_template takes these itself: never a template variable from a client.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """ValueError naming a key the template cannot be given."""
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"{key!r} is an argument of the template renderer, not a template variable")


class TokenizeRequest(msgspec.Struct, frozen=True, tag=True, tag_field="msg", kw_only=True):
    """Tokenize a prompt text, or chat messages with the chat template; answered with `Tokenized`."""

    request_id: str
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: ToolCalling | None = None  # rendered into the prompt as a chat request's tools are (count_tokens)
    chat_template_kwargs: dict[str, Any] = {}


class DetokenizeRequest(msgspec.Struct, frozen=True, tag=True, tag_field="msg", kw_only=True):
    """Decode token ids to text; answered with `Detokenized`."""

    request_id: str
    token_ids: tuple[int, ...]


class RewardCandidate(msgspec.Struct, frozen=True, kw_only=True):
    """One response to score: its steps as given, or its text to cut into steps at the delimiter.
    `param` is the request field it came from, named in a 400 about it."""

    steps: tuple[str, ...] | None = None
    text: str | None = None
    param: str = "response"


class RewardRequest(msgspec.Struct, frozen=True, tag=True, tag_field="msg", kw_only=True):
    """Score given responses step by step with a verifier, as a search scores its paths' steps;
    answered with `Rewarded`. The question is taken from `messages` (the conversation before the
    response) or `prompt` as a search takes it from its request."""

    request_id: str
    verifier: str
    candidates: tuple[RewardCandidate, ...]
    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | None = None
    step_delimiter: str = "\n\n"
    aggregation: str = "last"
    max_steps: int = 100  # a candidate with more steps is a 400


class AbortRequest(msgspec.Struct, frozen=True, tag=True, tag_field="msg"):
    request_id: str


class Shutdown(msgspec.Struct, frozen=True, tag=True, tag_field="msg"):
    pass


# ---------------------------------------------------------------------------------------------
# Runtime -> server


class Ready(msgspec.Struct, frozen=True, tag=True, tag_field="msg", kw_only=True):
    model: str
    max_model_len: int
    dtype: str
    device: str
    num_blocks: int
    block_size: int
    verifiers: tuple[str, ...] = ()
    quantize: str = "none"  # what the `quantize` setting became: none | int8 | int4 | float | gpu_blocks
    tool_call_format: str = "hermes"  # how the model writes a tool call: hermes | llama3_json | mistral
    reasoning_format: str = "none"  # how the model thinks in its text (runtime.wire.reasoning): none | think
    block_types: tuple[str, ...] = ()  # the GGUF block types its int layers keep, e.g. ("Q4_K", "Q6_K")
    # The model author's sampling defaults (runtime.model.generation_config), e.g. {"temperature": 0.7}: the
    # server applies each to a request that leaves that field unset. Empty: ponder's own (SamplingParams').
    sampling_defaults: dict[str, Union[int, float]] = {}
    # Which code computes each part of a step (runtime.model.paths): e.g. {"family": "llama", "layers": "lean",
    # "linear": "float_kernel", "attention": "cpu_kernel"}.
    paths: dict[str, str] = {}


class SettingsChecked(msgspec.Struct, frozen=True, tag=True, tag_field="msg", kw_only=True):
    """The runtime's first message, before it loads anything (runtime.preflight): None, or the one
    line naming a setting this machine cannot honour (status 2) or a checkpoint that would leave a
    weight at random (status 3)."""

    problem: str | None = None
    status: int = 0


class LoadProgress(msgspec.Struct, frozen=True, tag=True, tag_field="msg"):
    message: str


class LoadFailed(msgspec.Struct, frozen=True, tag=True, tag_field="msg"):
    message: str


class Accepted(msgspec.Struct, frozen=True, tag=True, tag_field="msg", kw_only=True):
    """The prompt was tokenized and admitted; usage figures for the prompt."""

    request_id: str
    prompt_tokens: int
    # The rendered prompt ends inside an open thinking block (runtime.wire.reasoning.opens_thinking):
    # the output starts in thinking.
    opens_thinking: bool = False


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    token: str
    logprob: float
    bytes: tuple[int, ...]


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[TopLogprob, ...] = ()


class RankedLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    token: str
    logprob: float
    rank: int  # 1: the most likely token at that position


class PromptLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One prompt token, scored by the tokens before it: no logprob or rank for the first token."""

    token_id: int
    token: str
    logprob: float | None = None
    rank: int | None = None
    top: tuple[RankedLogprob, ...] = ()  # the most likely tokens at that position, best first


class StepScore(msgspec.Struct, frozen=True, kw_only=True):
    score: float | None  # None: no step of the path was verified (a deadline came first)
    step_scores: tuple[float, ...]
    answer: str | None


class Delta(msgspec.Struct, frozen=True, tag=True, tag_field="msg", kw_only=True):
    """New text of one choice. The last delta of a choice carries its finish reason."""

    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None
    search: StepScore | None = None  # on the finishing delta of a search choice
    # On a choice's first Delta only, when asked (SamplingParams.echo, .prompt_logprobs).
    prompt_text: str | None = None
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None


class SearchEvent(msgspec.Struct, frozen=True, tag=True, tag_field="msg", kw_only=True):
    request_id: str
    step: int
    live_paths: int
    scores: tuple[float | None, ...]  # None for a path none of whose steps is verified yet


# The search tree: one node per step of each path, and the prompt as its root (node 0, step 0).
# A node's status goes from running to kept (its path went on), pruned or finished (its path ended as
# a candidate answer); selected marks the nodes of the returned answers, root included.
NODE_STATUSES = ("running", "kept", "pruned", "finished", "selected")


class TreeNode(msgspec.Struct, frozen=True, array_like=True):
    """A node joins the tree as running. A forked path's first node has its parent's node as parent."""

    id: int
    parent: int | None  # None: the root
    step: int


class NodeChange(msgspec.Struct, frozen=True, array_like=True):
    """A node's new status, with its step's text and verifier score once they are known."""

    id: int
    status: str
    text: str | None = None
    score: float | None = None  # None: the step was not verified (granularity) or is the root


class SearchTree(msgspec.Struct, frozen=True, tag=True, tag_field="msg", kw_only=True):
    """What changed in a search's tree since the previous SearchTree of the request (per-step deltas)."""

    request_id: str
    added: tuple[TreeNode, ...] = ()
    changed: tuple[NodeChange, ...] = ()
    done: bool = False  # the last one: the search chose its answers


class SearchSummary(msgspec.Struct, frozen=True, kw_only=True):
    strategy: str
    steps: int
    paths_explored: int
    tokens_generated: int
    tokens_returned: int
    verifier_tokens_prefilled: int
    verifier_calls: int
    prefix_hit_tokens: int
    seconds_generating: float
    seconds_verifying: float
    timed_out: bool = False  # the search ran out of timeout_s and answered with its best path so far
    # With timed_out: whether the step cut short was verified (a free verifier, `confidence`, always
    # is), or the answer was chosen by the scores of the last step verified in full (a model's
    # verification is not started past the deadline, and one still running then is abandoned).
    cut_step_verified: bool | None = None
    # With a greedy anchor (runtime.search.anchor): the tokens it decoded, and whether it is the answer
    # because no candidate outranked it; None when no anchor ran (greedy_anchor off, or temperature 0).
    anchor_tokens: int = 0
    answered_by_anchor: bool | None = None


class Finished(msgspec.Struct, frozen=True, tag=True, tag_field="msg", kw_only=True):
    """Every choice of the request has finished; usage for the whole request."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    search: SearchSummary | None = None
    # Of the completion tokens, the thinking ones (a chat request on a thinking model); None: not counted.
    reasoning_tokens: int | None = None


class Tokenized(msgspec.Struct, frozen=True, tag=True, tag_field="msg", kw_only=True):
    request_id: str
    token_ids: tuple[int, ...]
    max_model_len: int


class Detokenized(msgspec.Struct, frozen=True, tag=True, tag_field="msg", kw_only=True):
    request_id: str
    text: str


class Reward(msgspec.Struct, frozen=True, kw_only=True):
    steps: tuple[str, ...]  # as the verifier saw them: split, trailing delimiters stripped
    step_scores: tuple[float, ...]
    score: float  # the step scores aggregated as the request asked


class Rewarded(msgspec.Struct, frozen=True, tag=True, tag_field="msg", kw_only=True):
    """A RewardRequest's scores, one Reward per candidate in order; the verifier's input tokens
    (0 for a verifier without a model of its own to prefill), and of them those its prefix cache held."""

    request_id: str
    rewards: tuple[Reward, ...]
    input_tokens: int = 0
    cached_tokens: int = 0


class RequestError(msgspec.Struct, frozen=True, tag=True, tag_field="msg", kw_only=True):
    request_id: str
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class RuntimeStats(msgspec.Struct, frozen=True, tag=True, tag_field="msg", kw_only=True):
    """Counters are cumulative since the runtime started; gauges are the value now."""

    requests_running: int = 0
    requests_waiting: int = 0
    # {"tier/state": blocks}, state in used, cached, free
    kv_blocks: dict[str, int] = {}
    # {"src/dst": bytes}
    kv_transfer_bytes: dict[str, int] = {}
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefetch_stall_seconds: float = 0.0
    tokens_prompt: int = 0
    tokens_cached: int = 0
    tokens_generated: int = 0
    search_requests: dict[str, int] = {}
    search_paths: int = 0
    search_steps: int = 0
    speculative_tokens: dict[str, int] = {}
    # Observations since the previous RuntimeStats message (histogram samples).
    verifier_seconds: tuple[float, ...] = ()
    beam_group_sizes: tuple[int, ...] = ()


ToRuntime = Union[GenerateRequest, TokenizeRequest, DetokenizeRequest, RewardRequest, AbortRequest, Shutdown]
FromRuntime = Union[
    SettingsChecked, Ready, LoadProgress, LoadFailed, Accepted, Delta, SearchEvent, SearchTree, Finished, Tokenized, Detokenized,
    Rewarded, RequestError, RuntimeStats
]

_to_runtime_decoder = msgspec.msgpack.Decoder(ToRuntime)
_from_runtime_decoder = msgspec.msgpack.Decoder(FromRuntime)
_encoder = msgspec.msgpack.Encoder()


def encode(message: ToRuntime | FromRuntime) -> bytes:
    return _encoder.encode(message)


def decode_to_runtime(data: bytes) -> ToRuntime:
    return _to_runtime_decoder.decode(data)


def decode_from_runtime(data: bytes) -> FromRuntime:
    return _from_runtime_decoder.decode(data)
