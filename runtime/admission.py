"""What a request may ask of this engine: its prompt tokens and its max_tokens, checked against the
model and the KV cache before anything is scheduled."""

from __future__ import annotations

from runtime.protocol import GenerateRequest
from runtime.requests import InvalidRequest, prompt_token_ids


def admit(engine, request: GenerateRequest) -> tuple[list[int], int]:
    """The prompt's token ids and the output tokens allowed, or `InvalidRequest` naming the field."""
    config = engine.config
    if request.request_id in engine.requests or request.request_id in engine.searches:
        raise InvalidRequest(f"request id {request.request_id} is already running")
    ids = prompt_token_ids(request, engine.tokenizer)
    params = request.sampling
    if not ids:
        raise InvalidRequest("the prompt is empty", "prompt")
    if any(not 0 <= t < engine.vocab_size for t in ids):
        raise InvalidRequest(f"prompt token ids must lie in [0, {engine.vocab_size})", "prompt")
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
    num_blocks = engine.pool.num_blocks  # under token with tiers: what the tiers hold
    if engine.kv.num_blocks_for(len(ids) + max_tokens) > num_blocks:
        raise InvalidRequest(
            f"the prompt and max_tokens need {len(ids) + max_tokens} tokens of KV cache, more than the "
            f"{num_blocks * config.block_size} this server holds", "max_tokens")
    if any(not 0 <= t < engine.vocab_size for t in params.stop_token_ids):
        raise InvalidRequest(f"stop_token_ids must lie in [0, {engine.vocab_size})", "stop_token_ids")
    if params.top_logprobs > 20:
        raise InvalidRequest("top_logprobs must be at most 20", "top_logprobs")
    return ids, max_tokens
