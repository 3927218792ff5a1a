"""The grammar room on the embedded model's tokenizer: what compiles, what is refused with the field
named, forks at a point equal a fresh run to it, and the masks are llguidance's own."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from runtime.grammar.compiler import GrammarError
from runtime.grammar.matcher import Grammar, allowed_tokens
from runtime.wire.params import Constraint, ToolCalling

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def grammar_for(compiler, constraint=None, tools=None) -> Grammar:
    text, param = compiler.key(constraint, tools)
    return Grammar(compiler.compile_now(text, param), compiler.num_words)


def accepts(compiler, grammar: Grammar, text: str) -> bool:
    """Whether `text` (as the tokenizer writes it) is a whole match."""
    ids = compiler_ids(compiler, text)
    constraint = grammar.start()
    if constraint.matcher.validate_tokens(ids) != len(ids):
        return False
    for token in ids:
        constraint.consume(token)
    return constraint.is_complete


def compiler_ids(compiler, text: str) -> list[int]:
    return compiler.tokenizer.tokenize_str(text)


@pytest.mark.parametrize("constraint, good, bad", [
    (Constraint(kind="json_schema", spec=json.dumps(SCHEMA)), '{"name": "Alec", "age": 20}', '{"name": "Alec"}'),
    (Constraint(kind="json_object"), '{"a": [1, 2]}', "[1, 2]"),
    (Constraint(kind="regex", spec="[0-9]{3}-[a-z]+"), "123-abc", "12-abc"),
    (Constraint(kind="choice", spec=json.dumps(["yes", "no"])), "no", "maybe"),
    (Constraint(kind="grammar", spec='root ::= "a" ("b")*'), "abbb", "ba"),  # GBNF
    (Constraint(kind="grammar", spec='start: "x" NUMBER\nNUMBER: /[0-9]+/'), "x42", "x"),  # Lark
])
def test_each_kind_accepts_what_matches_and_nothing_else(compiler, constraint, good, bad):
    grammar = grammar_for(compiler, constraint)
    assert accepts(compiler, grammar, good)
    assert not accepts(compiler, grammar, bad)


@pytest.mark.parametrize("constraint, param", [
    (Constraint(kind="json_schema", spec='{"type": "objectx"}', param="response_format.json_schema.schema"),
     "response_format.json_schema.schema"),
    (Constraint(kind="json_schema", spec="{not json", param="structured_outputs.json"), "structured_outputs.json"),
    (Constraint(kind="json_schema", spec="[1, 2]", param="guided_json"), "guided_json"),
    (Constraint(kind="regex", spec="[0-9", param="guided_regex"), "guided_regex"),
    (Constraint(kind="grammar", spec="start: undefined_rule", param="structured_outputs.grammar"),
     "structured_outputs.grammar"),
])
def test_what_does_not_compile_names_its_field(compiler, constraint, param):
    with pytest.raises(GrammarError) as raised:
        text, text_param = compiler.key(constraint, None)
        compiler.compile_now(text, text_param)
    assert raised.value.param == param
    assert str(raised.value)


def test_a_fork_at_k_tokens_is_a_fresh_constraint_that_consumed_k(compiler):
    grammar = grammar_for(compiler, Constraint(kind="json_schema", spec=json.dumps(SCHEMA)))
    ids = compiler_ids(compiler, '{"name": "Alec", "age": 20}')
    whole = grammar.start()
    for token in ids:
        whole.consume(token)
    for k in (0, 3, len(ids) - 1):
        forked = whole.fork(k)
        fresh = grammar.start()
        for token in ids[:k]:
            fresh.consume(token)
        assert forked.num_consumed == k
        assert torch.equal(allowed_tokens([forked], 49152, "cpu"), allowed_tokens([fresh], 49152, "cpu"))
    assert whole.is_complete and whole.num_consumed == len(ids)  # the parent keeps its tokens


def test_masks_are_llguidance_s_own_bits_row_by_row(compiler):
    grammar = grammar_for(compiler, Constraint(kind="regex", spec="(ab|cd)[0-9]+"))
    a, b = grammar.start(), grammar.start()
    b.consume(compiler_ids(compiler, "ab")[0])
    rows = allowed_tokens([a, b], 49152, "cpu")
    for row, constraint in enumerate((a, b)):
        bits = np.frombuffer(constraint.matcher.compute_bitmask(), dtype=np.uint8)
        expected = np.unpackbits(bits, bitorder="little")[:49152].astype(bool)
        assert np.array_equal(rows[row].numpy(), expected)
        assert 0 < int(rows[row].sum()) < 49152


def test_required_tools_admit_only_valid_calls(compiler):
    grammar = grammar_for(compiler, tools=ToolCalling(tools=(WEATHER, TIME), choice="required"))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts(compiler, grammar, call)
    assert accepts(compiler, grammar, call + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not accepts(compiler, grammar, "It is sunny.")
    assert not accepts(compiler, grammar, call.replace('"city"', '"town"'))  # arguments break the schema
    assert not accepts(compiler, grammar, call.replace("get_weather", "get_wether"))


def test_a_named_function_without_parallel_calls_admits_one_call_of_it(compiler):
    grammar = grammar_for(compiler, tools=ToolCalling(tools=(WEATHER, TIME), choice="function", name="get_time",
                                                      parallel=False))
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert accepts(compiler, grammar, call)
    assert not accepts(compiler, grammar, call + "\n" + call)
    assert not accepts(compiler, grammar, call.replace("get_time", "get_weather"))


def test_auto_lets_the_model_answer_in_text_but_a_call_it_starts_must_be_valid(compiler):
    grammar = grammar_for(compiler, tools=ToolCalling(tools=(WEATHER,), choice="auto"))
    assert accepts(compiler, grammar, "It is sunny in Paris.")
    assert accepts(compiler, grammar, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert not accepts(compiler, grammar, '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}\n</tool_call>')


def test_llama3_calls_are_bare_objects_with_parameters(smollm_tokenizer):
    from runtime.grammar.compiler import GrammarCompiler

    compiler = GrammarCompiler(smollm_tokenizer, len(smollm_tokenizer), frozenset({2}), "llama3_json")
    try:
        grammar = grammar_for(compiler, tools=ToolCalling(tools=(WEATHER,), choice="required"))
        assert accepts(compiler, grammar, '{"name": "get_weather", "parameters": {"city": "Paris"}}')
        assert not accepts(compiler, grammar, '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    finally:
        compiler.close()


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "integer"}, "9" * 16, "9" * 17),
    ({"type": "number"}, "-" + "9" * 15 + ".5", "1" + "0" * 16),
    ({"type": ["integer", "number"]}, "-" + "9" * 16, "-" + "1" * 17),
    ({"type": ["integer", "null"]}, "null", "1" * 17),
    ({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}, '{"n": 7}', '{"n": ' + "7" * 17 + "}"),
    ({"type": "integer", "minimum": 0}, "1" * 16, "-1"),  # its own bound stands; the other side is capped
    ({"type": "integer", "maximum": 10 ** 18}, "1" * 18, "-" + "1" * 17),
])
def test_an_unbounded_number_has_at_most_16_integral_digits(compiler, schema, good, bad):
    """As llama.cpp's schema grammars: a small model writing a digit a token would otherwise fill
    max_tokens inside one integer."""
    grammar = grammar_for(compiler, Constraint(kind="json_schema", spec=json.dumps(schema)))
    assert accepts(compiler, grammar, good)
    assert not accepts(compiler, grammar, bad)


def test_a_json_object_is_any_object_with_bounded_numbers(compiler):
    grammar = grammar_for(compiler, Constraint(kind="json_object"))
    assert accepts(compiler, grammar, '{"a": {"b": [true, null, "x", -1.5, {"c": 3}]}, "d": []}')
    assert not accepts(compiler, grammar, '{"a": ' + "1" * 17 + "}")
    assert not accepts(compiler, grammar, '["not", "an object"]')


def test_bounds_reach_every_subschema_but_never_a_value():
    from runtime.grammar.schema import NUMBER_BOUND, tightened

    schema = {"type": "object", "properties": {"type": {"type": "integer"}, "k": {"const": {"type": "integer"}}},
              "$defs": {"n": {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "string"}]}}}
    out = tightened(schema)
    assert out["additionalProperties"] is False and set(out["properties"]) == {"type", "k"}
    assert out["properties"]["type"] == {"type": "integer", "minimum": -NUMBER_BOUND, "maximum": NUMBER_BOUND}
    assert out["properties"]["k"] == {"const": {"type": "integer"}}
    assert out["$defs"]["n"]["anyOf"] == [{"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e16},
                                          {"type": "string"}]
    assert schema["properties"]["type"] == {"type": "integer"}  # the client's schema is left as it came


@pytest.mark.parametrize("schema, extra_allowed", [
    (SCHEMA_OPEN := {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}, False),
    ({**SCHEMA_OPEN, "additionalProperties": True}, True),  # the schema's own word stands
    ({**SCHEMA_OPEN, "additionalProperties": {"type": "integer"}}, True),
    ({"type": "object"}, True),  # no properties named: any object
])
def test_properties_the_schema_does_not_name_are_left_out_unless_it_allows_them(compiler, schema, extra_allowed):
    """As llama.cpp's schema grammars and xgrammar's strict mode: a small model otherwise invents
    property after property until max_tokens."""
    grammar = grammar_for(compiler, Constraint(kind="json_schema", spec=json.dumps(schema)))
    assert accepts(compiler, grammar, '{"name": "Ada"}')
    assert accepts(compiler, grammar, '{"name": "Ada", "age": 3}') == extra_allowed


def test_the_members_of_an_all_of_keep_their_properties_open():
    from runtime.grammar.schema import tightened

    schema = {"allOf": [{"properties": {"a": {"type": "string"}}}, {"properties": {"b": {"type": "string"}}}],
              "properties": {"properties": {"type": "string"}}}
    out = tightened(schema)
    assert all("additionalProperties" not in member for member in out["allOf"])
    assert out["properties"] == {"properties": {"type": "string"}} and "additionalProperties" not in out
    assert tightened({"properties": {"properties": {}}})["properties"] == {"properties": {}}  # a name, not a schema
