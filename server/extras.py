"""No request field dropped in silence: vLLM's and llama.cpp's documented request extras that ponder does
not declare as fields, each accepted at the value whose behaviour ponder already has and refused by name at
any other; and every other field no schema declares, found anywhere in a body (`unknown_fields`), which the
server refuses or logs (`server.unknown_fields`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from server.errors import APIError

log = logging.getLogger("ponder.server")

@dataclass(frozen=True)
class Extra:
    """A documented extra: the values that ask for what ponder does anyway (None always: not sent), and
    why any other is refused."""

    obeyed: tuple[Any, ...]
    why: str
    switch: str | None = None  # the sampler this knob tunes: any value is inert while that stays off

    def accepts(self, value: Any) -> bool:
        """A knob is accepted at any value: on its own it does nothing, and its sampler switched on is
        refused under the switch's name."""
        return value is None or self.switch is not None or any(_same(value, ok) for ok in self.obeyed)


def _same(value: Any, ok: Any) -> bool:
    """Equal, and of the same kind: `true` is not `1`, but `1` is `1.0`."""
    if isinstance(ok, bool) or isinstance(value, bool):
        return type(value) is type(ok) and value == ok
    if isinstance(ok, (int, float)):
        return isinstance(value, (int, float)) and value == ok
    return type(value) is type(ok) and value == ok


def _no(what: str, instead: str = "") -> str:
    return f"{what} is not supported" + (f"; {instead}" if instead else "")


_SEARCH = "ask for more thought with the `search` extension (docs/search.md)"
_STRUCTURED = "use response_format or structured_outputs (docs/structured-outputs.md)"

# vLLM's extra parameters of /v1/chat/completions and /v1/completions (its docs, "Extra Parameters"), and
# llama.cpp server's sampling options, that no schema field declares. The fields ponder obeys in full
# (top_k, min_p, repetition_penalty, stop_token_ids, structured_outputs, prompt_logprobs, ...) are fields.
VENDOR_EXTRAS: dict[str, Extra] = {
    # vLLM: sampling
    "use_beam_search": Extra((False,), _no("use_beam_search", "use search.strategy \"beam\"")),
    "length_penalty": Extra((1.0,), _no("length_penalty", "it applies to vLLM's beam search only")),
    "min_tokens": Extra((0,), _no("min_tokens")),
    "skip_special_tokens": Extra((True,), _no("keeping special tokens in the text (skip_special_tokens false)")),
    "spaces_between_special_tokens": Extra((True,), _no("spaces_between_special_tokens false")),
    "truncate_prompt_tokens": Extra((), _no("truncating the prompt", "a prompt longer than the context is a 400")),
    "allowed_token_ids": Extra((), _no("allowed_token_ids", "use logit_bias or structured_outputs")),
    "bad_words": Extra(([],), _no("bad_words", "use logit_bias")),
    "logits_processors": Extra(([],), _no("custom logits processors")),
    "vllm_xargs": Extra(({},), _no("vllm_xargs")),
    "return_tokens_as_token_ids": Extra((False,), _no("return_tokens_as_token_ids")),
    "return_token_ids": Extra((False,), _no("return_token_ids", "POST /tokenize gives a text's ids")),
    "priority": Extra((0,), _no("request priorities")),
    "request_id": Extra((), _no("a client's request_id", "the response's id is the server's")),
    "cache_salt": Extra((), _no("cache_salt", "the prefix cache is shared by every request")),
    "kv_transfer_params": Extra((), _no("kv_transfer_params")),
    "mm_processor_kwargs": Extra(({},), _no("mm_processor_kwargs", "this server serves text models")),
    "media_io_kwargs": Extra(({},), _no("media_io_kwargs", "this server serves text models")),
    "prompt_embeds": Extra((), _no("prompt_embeds", "send a prompt text or token ids")),
    # vLLM: chat templating
    "add_generation_prompt": Extra((True,), _no("add_generation_prompt false", "use /v1/completions with a prompt")),
    "continue_final_message": Extra((False,), _no("continue_final_message", "use /v1/completions with a prompt")),
    "chat_template": Extra((), _no("a chat template in the request", "the model's own template renders it")),
    "documents": Extra(([],), _no("documents")),
    "echo": Extra((False,), _no("echo on chat completions", "use /v1/completions with echo")),
    # vLLM: structured outputs, older spellings
    "guided_decoding_backend": Extra((), _no("choosing the structured-output backend", _STRUCTURED)),
    "guided_whitespace_pattern": Extra((), _no("guided_whitespace_pattern", _STRUCTURED)),
    "structural_tag": Extra((), _no("structural_tag", _STRUCTURED)),
    # llama.cpp server
    "n_predict": Extra((-1,), _no("n_predict", "use max_tokens")),
    "cache_prompt": Extra((True,), _no("cache_prompt false", "every prompt's blocks go to the prefix cache")),
    "n_probs": Extra((0,), _no("n_probs", "use logprobs and top_logprobs")),
    "typical_p": Extra((1.0,), _no("typical_p")),
    "mirostat": Extra((0,), _no("mirostat")),
    "mirostat_tau": Extra((), _no("mirostat_tau"), switch="mirostat"),
    "mirostat_eta": Extra((), _no("mirostat_eta"), switch="mirostat"),
    "dynatemp_range": Extra((0.0,), _no("dynatemp_range")),
    "dynatemp_exponent": Extra((), _no("dynatemp_exponent"), switch="dynatemp_range"),
    "xtc_probability": Extra((0.0,), _no("xtc_probability")),
    "xtc_threshold": Extra((), _no("xtc_threshold"), switch="xtc_probability"),
    "dry_multiplier": Extra((0.0,), _no("dry_multiplier")),
    "dry_base": Extra((), _no("dry_base"), switch="dry_multiplier"),
    "dry_allowed_length": Extra((), _no("dry_allowed_length"), switch="dry_multiplier"),
    "dry_penalty_last_n": Extra((), _no("dry_penalty_last_n"), switch="dry_multiplier"),
    "dry_sequence_breakers": Extra((), _no("dry_sequence_breakers"), switch="dry_multiplier"),
    "repeat_penalty": Extra((1.0,), _no("repeat_penalty", "use repetition_penalty (over the whole text)")),
    "repeat_last_n": Extra((), _no("repeat_last_n"), switch="repeat_penalty"),
    "penalize_nl": Extra((False,), _no("penalize_nl")),
    "top_n_sigma": Extra((-1,), _no("top_n_sigma")),
    "min_keep": Extra((0,), _no("min_keep")),
    "samplers": Extra((), _no("choosing the samplers' order")),
    "n_keep": Extra((0,), _no("n_keep", "a prompt longer than the context is a 400")),
    "n_indent": Extra((0,), _no("n_indent")),
    "id_slot": Extra((-1,), _no("id_slot")),
    "t_max_predict_ms": Extra((0,), _no("t_max_predict_ms", "search.timeout_s bounds a search")),
    "grammar": Extra(("",), _no("llama.cpp's GBNF grammar field", "use structured_outputs.grammar (Lark)")),
    "json_schema": Extra(({},), _no("llama.cpp's json_schema field", _STRUCTURED)),
    "lora": Extra(([],), _no("LoRA adapters")),
    "post_sampling_probs": Extra((False,), _no("post_sampling_probs")),
    "return_tokens": Extra((False,), _no("return_tokens", "POST /tokenize gives a text's ids")),
    "timings_per_token": Extra((False,), _no("timings_per_token", "GET /metrics has the timings")),
    "return_progress": Extra((False,), _no("return_progress")),
    "thinking_forced_open": Extra((False,), _no("thinking_forced_open")),
    "parse_tool_calls": Extra((True,), _no("parse_tool_calls false", "leave tools out")),
}

# Per endpoint, where what ponder does differs: chat templates add no special tokens (vLLM's defaults).
_ENDPOINT_OBEYED = {("chat", "add_special_tokens"): (False,), ("completion", "add_special_tokens"): (True,)}
_ENDPOINT_WHY = {"add_special_tokens": _no("changing add_special_tokens", "the default of each endpoint applies")}


def refused_extra(extras: dict[str, Any], endpoint: str) -> tuple[str, str] | None:
    """(field, why) for the first documented extra in `extras` (a body's undeclared fields) sent at a value
    ponder cannot obey; None if there is none."""
    for name, value in extras.items():
        if (endpoint, name) in _ENDPOINT_OBEYED:
            if value is not None and not any(_same(value, ok) for ok in _ENDPOINT_OBEYED[endpoint, name]):
                return name, _ENDPOINT_WHY[name]
            continue
        extra = VENDOR_EXTRAS.get(name)
        if extra is not None and not extra.accepts(value):
            return name, extra.why
    return None


def is_documented(name: str, endpoint: str) -> bool:
    return name in VENDOR_EXTRAS or (endpoint, name) in _ENDPOINT_OBEYED


def unknown_fields(body: BaseModel, endpoint: str = "", prefix: str = "") -> list[str]:
    """The dotted path of every field no schema declares, anywhere in `body` (held by models that allow
    extras), the documented extras at the top level left out."""
    found = []
    for name, value in (body.model_extra or {}).items():
        if prefix or not is_documented(name, endpoint):
            found.append(prefix + name)
    for name in type(body).model_fields:
        value = getattr(body, name)
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            if isinstance(item, BaseModel):
                where = f"{prefix}{name}." + ("" if index is None else f"{index}.")
                found += unknown_fields(item, endpoint, where)
    return found


def check_fields(body: BaseModel, endpoint: str, policy: str) -> None:
    """A 400 naming a documented extra sent at a value ponder cannot obey; for a field no schema declares,
    a 400 naming it (`policy` "error", OpenAI's behaviour) or one logged warning ("warn")."""
    refused = refused_extra(body.model_extra or {}, endpoint)
    if refused is not None:
        raise APIError(400, f"{refused[0]}: {refused[1]}", refused[0])
    unknown = unknown_fields(body, endpoint)
    if not unknown:
        return
    if policy == "warn":
        log.warning("ignored fields no schema declares: %s", ", ".join(unknown))
        return
    raise APIError(400, f"unknown parameter: {unknown[0]!r} (no field of this name is obeyed)", unknown[0],
                   "unknown_parameter")
