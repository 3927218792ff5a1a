"""What a request may ask of this engine: its prompt tokens, its max_tokens and a search's verifier and
path counts, checked against the model, the KV cache and the verifiers before anything is scheduled."""

from __future__ import annotations

from collections.abc import Collection, Container
from typing import TYPE_CHECKING

from runtime.grammar.thinking import ThinkingMarkers, ThinkingStart
from runtime.kv.head_pieces import NoFit, plan_pieces
from runtime.model.loader import SettingError
from runtime.wire.protocol import GenerateRequest
from runtime.requests.state import InvalidRequest, prompt_token_ids
from scheduler.kv_manager import KVManager

if TYPE_CHECKING:
    from runtime.kv.host import StreamHost
    from runtime.kv.headwise import HeadwiseResidency

GRANULARITIES = ("block", "head")


def admit(request: GenerateRequest, running: tuple[Container[str], ...], tokenizer, vocab_size: int, config,
          kv: KVManager, streamed: HeadwiseResidency | None, *,
          verifiers: Collection[str]) -> tuple[list[int], int]:
    """The prompt's token ids and the output tokens allowed, or `InvalidRequest` naming the field.
    `running`: the ids of the requests under way; `config`: the engine's settings (`max_model_len`,
    `block_size`); `kv`: the compute pool's, which says how many blocks a request needs and has;
    `verifiers`: the names of the verifiers a search may ask for."""
    if any(request.request_id in ids for ids in running):
        raise InvalidRequest(f"request id {request.request_id} is already running")
    ids = prompt_token_ids(request, tokenizer)
    params = request.sampling
    if not ids:
        raise InvalidRequest("the prompt is empty", "prompt")
    if any(not 0 <= t < vocab_size for t in ids):
        raise InvalidRequest(f"prompt token ids must lie in [0, {vocab_size})", "prompt")
    room = config.max_model_len - len(ids)
    if room <= 0:
        raise InvalidRequest(
            f"this model's maximum context length is {config.max_model_len} tokens, and the prompt "
            f"has {len(ids)} tokens", "messages" if request.messages is not None else "prompt",
            code="context_length_exceeded")
    max_tokens = room if params.max_tokens is None else params.max_tokens
    if max_tokens > room:
        raise InvalidRequest(
            f"this model's maximum context length is {config.max_model_len} tokens; the prompt has "
            f"{len(ids)} tokens and max_tokens is {max_tokens}, {len(ids) + max_tokens} in all",
            "max_tokens", code="context_length_exceeded")
    num_blocks = kv.pool.num_blocks  # under token with tiers: what the tiers hold
    if kv.num_blocks_for(len(ids) + max_tokens) > num_blocks:
        _check_streamed(request, len(ids) + max_tokens, num_blocks * config.block_size, streamed)
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise InvalidRequest(f"stop_token_ids must lie in [0, {vocab_size})", "stop_token_ids")
    if any(not 0 <= t < vocab_size for t, _ in params.logit_bias):
        raise InvalidRequest(f"logit_bias keys must be token ids in [0, {vocab_size})", "logit_bias")
    if params.top_logprobs > 20:
        raise InvalidRequest("top_logprobs must be at most 20", "top_logprobs")
    if request.search is not None:
        _check_search(request, verifiers)
    return ids, max_tokens


def _check_search(request: GenerateRequest, verifiers: Collection[str]) -> None:
    search = request.search
    if search.verifier not in verifiers:
        raise InvalidRequest(f"unknown verifier {search.verifier!r}; this server has "
                             f"{', '.join(sorted(verifiers))}", "search.verifier")
    if search.strategy == "dvts" and search.n % search.beam_width:
        raise InvalidRequest("dvts needs search.n to be a multiple of search.beam_width", "search.n")
    if request.sampling.n > search.n:
        raise InvalidRequest("n (choices returned) cannot exceed search.n (paths explored)", "n")


def _check_streamed(request: GenerateRequest, num_tokens: int, held: int,
                    streamed: HeadwiseResidency | None) -> None:
    """A request over the compute pool (which holds `held` tokens) may stream head-wise (one choice,
    no search) if the host and disk tiers hold its KV; otherwise it is refused, saying how many
    tokens would fit."""
    if streamed is None or request.search is not None or request.sampling.n > 1:
        raise InvalidRequest(
            f"the prompt and max_tokens need {num_tokens} tokens of KV cache, more than the {held} this "
            f"server holds" + ("" if streamed is None else " for a search or several choices"), "max_tokens")
    if not streamed.fits(num_tokens - 1):  # the last token is sampled, never fed back
        fit = max(held, streamed.max_tokens() + 1)
        raise InvalidRequest(
            f"the prompt and max_tokens need {num_tokens} tokens of KV cache; streamed head by head through "
            f"the compute tier, the host and disk tiers hold at most {fit} tokens", "max_tokens")


def check_budget(shape, num_blocks: int, max_model_len: int, granularity: str) -> None:
    """Raise `SettingError`, naming the setting, for a granularity that does not exist or a compute
    budget below one path's working set: the block it writes and a copy-on-write copy of it, or
    (head) one sequence of `max_model_len` tokens streamed through the compute tier."""
    if granularity not in GRANULARITIES:
        raise SettingError(f"scheduler.kv_granularity = {granularity!r} is not one of {', '.join(GRANULARITIES)}")
    if num_blocks < 2:
        raise SettingError(f"cache.num_blocks = {num_blocks}: one path needs at least 2 blocks (the block it "
                           f"writes and a copy-on-write copy of it)")
    if granularity == "head":
        plan = plan_pieces(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, group_heads=1,
                           head_dim=shape.head_dim, block_size=shape.block_size, max_tokens=max_model_len,
                           budget_pieces=num_blocks * shape.num_layers * shape.num_kv_heads, prefetch=True)
        if isinstance(plan, NoFit):
            raise SettingError(f"scheduler.kv_granularity = head: a compute budget of {num_blocks} blocks cannot "
                               f"stream one sequence of max_model_len {max_model_len} tokens: {plan.reason}")


def check_granularity(host: StreamHost, config, model_key: bytes) -> HeadwiseResidency | None:
    """The head-wise residency of requests over the compute pool when `kv_granularity = head`, after
    `check_budget` (`config`: the engine's settings)."""
    from runtime.kv.headwise import HeadwiseResidency  # the model side: start-up's settings check needs none of it

    check_budget(host.cache.shape, config.num_blocks, config.max_model_len, config.kv_granularity)
    if config.kv_granularity == "head" and host.runner.recurrent is not None:
        raise SettingError("scheduler.kv_granularity = head: the model's linear-attention (Gated DeltaNet) layers "
                           "keep a recurrent state per sequence, which head-wise streaming does not carry; use block")
    return HeadwiseResidency(host, config, model_key) if config.kv_granularity == "head" else None


def thinking_start(request: GenerateRequest, is_open: bool, reasoning_format: str,
                   markers: ThinkingMarkers | None, has_grammar: bool) -> ThinkingStart | None:
    """How a chat request's outputs begin on a thinking model (its generation prompt opens a thinking
    block: `is_open`), else None; a budget the model cannot be held to, or a grammar that would hold the
    thinking too, is a 400."""
    budget = request.sampling.thinking_token_budget
    if budget is not None and (markers is None or request.messages is None):
        why = "this model's output (it does not think in its text, in one-token tags)" \
            if request.messages is not None else "a completion"
        raise InvalidRequest(f"a thinking budget cannot be applied to {why}", "thinking_token_budget")
    if has_grammar and is_open and markers is None:
        raise InvalidRequest("the grammar would hold the thinking too: this model's thinking tags are not "
                             "one token each; send chat_template_kwargs: {\"enable_thinking\": false}",
                             "chat_template_kwargs")
    if request.messages is None or reasoning_format == "none":
        return None
    return ThinkingStart(reasoning_format, is_open, markers)
