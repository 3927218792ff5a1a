"""Request fields no schema declares: vLLM's and llama.cpp's documented extras accepted at the value whose
behaviour ponder has and refused by name at any other; any other field a 400 naming its path, or a logged
warning under `server.unknown_fields = "warn"`. (The live checks are in test_openai_fields.py.)"""

from __future__ import annotations

import logging

import pytest

from server.errors import APIError
from server.extras import VENDOR_EXTRAS, check_fields, refused_extra, unknown_fields
from server.non_openai_schemas import TokenizeBody
from server.schemas import ChatCompletionRequest, CompletionRequest

ASK = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **fields})


def refusal(body, endpoint: str = "chat", policy: str = "error") -> tuple[str, str, str | None]:
    with pytest.raises(APIError) as caught:
        check_fields(body, endpoint, policy)
    err = caught.value
    assert err.status == 400 and err.type == "invalid_request_error"
    return err.param, err.message, err.code


def test_an_unknown_top_level_field_is_a_400_naming_it():
    assert refusal(chat(frobnicate=1)) == (
        "frobnicate", "unknown parameter: 'frobnicate' (no field of this name is obeyed)", "unknown_parameter")


def test_unknown_fields_inside_messages_stream_options_and_parts_are_named_by_path():
    body = chat(messages=[{"role": "system", "content": "s"},
                          {"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}],
                           "colour": "red"}],
                stream=True, stream_options={"include_usage": True, "verbose": True})
    # In the order the schema declares its fields, a part's own fields before those of its parts.
    assert unknown_fields(body, "chat") == ["stream_options.verbose", "messages.1.colour",
                                            "messages.1.content.0.cache_control"]
    assert refusal(body)[0] == "stream_options.verbose"


def test_warn_logs_every_unknown_field_once_and_lets_the_request_through(caplog):
    body = chat(frobnicate=1, messages=[{"role": "user", "content": "x", "colour": "red"}])
    with caplog.at_level(logging.WARNING, logger="ponder.server"):
        check_fields(body, "chat", "warn")
    assert [r.getMessage() for r in caplog.records] == [
        "ignored fields no schema declares: frobnicate, messages.0.colour"]


def test_known_fields_and_an_echoed_answer_pass():
    answer = {"role": "assistant", "content": "4", "refusal": None, "annotations": [], "audio": None,
              "reasoning_content": "2 and 2", "tool_calls": None, "function_call": None}
    body = chat(messages=[*ASK, answer, {"role": "user", "content": "again"}], top_k=5, min_p=0.1,
                stop_token_ids=[3], stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    check_fields(body, "chat", "error")
    assert body.wire_messages()[1] == {"role": "assistant", "content": "4", "reasoning_content": "2 and 2"}


def test_reasoning_is_vllms_name_for_the_same_thinking_and_a_user_message_carries_none():
    body = chat(messages=[{"role": "assistant", "content": "4", "reasoning": "2 and 2"},
                          {"role": "user", "content": "x", "reasoning_content": "ignored"}])
    assert body.wire_messages() == ({"role": "assistant", "content": "4", "reasoning_content": "2 and 2"},
                                    {"role": "user", "content": "x"})


@pytest.mark.parametrize("field, value", [
    ("skip_special_tokens", True), ("spaces_between_special_tokens", True), ("min_tokens", 0),
    ("add_generation_prompt", True), ("continue_final_message", False), ("echo", False), ("priority", 0),
    ("use_beam_search", False), ("length_penalty", 1), ("cache_prompt", True), ("n_probs", 0),
    ("typical_p", 1.0), ("mirostat", 0), ("repeat_penalty", 1.0), ("add_special_tokens", False),
    ("truncate_prompt_tokens", None), ("samplers", None), ("xtc_probability", 0), ("n_predict", -1)])
def test_a_documented_extra_at_the_value_ponder_obeys_is_accepted(field, value):
    check_fields(chat(**{field: value}), "chat", "error")


@pytest.mark.parametrize("field, value, says", [
    ("skip_special_tokens", False, "skip_special_tokens false"), ("min_tokens", 4, "min_tokens"),
    ("use_beam_search", True, "search.strategy"), ("add_generation_prompt", False, "/v1/completions"),
    ("truncate_prompt_tokens", 100, "truncating"), ("chat_template", "{{ x }}", "chat template"),
    ("echo", True, "/v1/completions with echo"), ("repeat_penalty", 1.3, "repetition_penalty"),
    ("mirostat", 2, "mirostat"), ("n_predict", 12, "max_tokens"), ("min_tokens", True, "min_tokens"),
    ("add_special_tokens", True, "add_special_tokens"),
    ("grammar", "root ::= \"a\"", "structured_outputs.grammar")])
def test_a_documented_extra_at_another_value_is_a_400_naming_it(field, value, says):
    param, message, _ = refusal(chat(**{field: value}))
    assert param == field and says in message


def test_a_samplers_knob_is_inert_while_its_sampler_is_off():
    check_fields(chat(mirostat_tau=5.0, mirostat_eta=0.1, dry_base=1.75, xtc_threshold=0.1,
                      repeat_last_n=64), "chat", "error")
    assert refusal(chat(mirostat=1, mirostat_tau=5.0))[0] == "mirostat"
    assert refused_extra({"mirostat_tau": 4.0, "mirostat": 2}, "chat") == ("mirostat", VENDOR_EXTRAS["mirostat"].why)
    assert refusal(chat(dry_multiplier=0.8, dry_base=1.75))[0] == "dry_multiplier"


def test_add_special_tokens_defaults_differ_by_endpoint():
    completion = CompletionRequest.model_validate({"prompt": "x", "add_special_tokens": True})
    check_fields(completion, "completion", "error")
    refused = CompletionRequest.model_validate({"prompt": "x", "add_special_tokens": False})
    assert refusal(refused, "completion")[0] == "add_special_tokens"


def test_best_of_is_obeyed_where_it_equals_n_and_refused_by_name_otherwise():
    assert CompletionRequest.model_validate({"prompt": "x", "n": 2, "best_of": 2}).best_of == 2
    with pytest.raises(ValueError, match="best_of other than n"):
        CompletionRequest.model_validate({"prompt": "x", "best_of": 3})


def test_the_other_endpoints_bodies_are_checked_too():
    assert refusal(TokenizeBody.model_validate({"prompt": "x", "return_token_strs": True}), "tokenize")[0] == \
        "return_token_strs"
