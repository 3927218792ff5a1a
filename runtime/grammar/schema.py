"""The JSON a constrained model writes: its separators and spacing, the digits a number may have, and
no property its schema does not name.
Both the schema of `response_format` and a tool's parameters pass through here before llguidance."""

from __future__ import annotations

# The JSON the model writes: ", " and ": " between items (as models trained on JSON write it), and
# no free whitespace (a small model given the choice writes newlines until max_tokens).
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
# A number's integral part has at most 16 digits unless the schema bounds it, as in llama.cpp's schema
# grammars: llguidance allows any number of digits, and a small model writing one digit a token fills
# max_tokens inside an integer. (A bound also leaves out exponents, which llama.cpp allows.)
NUMBER_BOUND = 10 ** 16 - 1
_VALUE = {"$ref": "#/$defs/value"}
# `response_format: json_object`: any JSON object, spelled out so that its numbers are bounded too.
ANY_OBJECT = {"type": "object", "additionalProperties": _VALUE, "$defs": {"value": {"anyOf": [
    {"type": "object", "additionalProperties": _VALUE}, {"type": "array", "items": _VALUE}, {"type": "string"},
    {"type": "number"}, {"type": "boolean"}, {"type": "null"}]}}}
DATA_KEYS = frozenset({"const", "enum", "default", "examples"})  # values, not schemas
SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"})  # name -> schema
COMBINED = frozenset({"allOf", "anyOf", "oneOf", "$ref"})  # beside these, properties combine with theirs
OTHER_PROPERTIES = frozenset({"additionalProperties", "patternProperties", "unevaluatedProperties"})


def tightened(schema, *, merged: bool = False):
    """`schema` as ponder constrains it (a copy; every subschema is walked, `$defs` and combinators
    included, never the values of `const`, `enum`, `default` or `examples`):
    - an `integer` or `number` with no bound on a side is bounded there (16 digits);
    - an object schema with `properties` and no word on others gets `additionalProperties: false`,
      as llama.cpp's schema grammars and xgrammar's strict mode have it (a small model otherwise
      invents property after property until max_tokens); not the direct members of an `allOf`, nor
      a schema beside a combinator or a `$ref`, whose properties combine with others'."""
    if isinstance(schema, list):
        return [tightened(item, merged=merged) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in DATA_KEYS:
            out[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: tightened(sub) for name, sub in value.items()}
        else:
            out[key] = tightened(value, merged=key == "allOf")
    if "properties" in schema and not merged and not (OTHER_PROPERTIES | COMBINED) & schema.keys():
        out["additionalProperties"] = False
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "number" in kinds:  # floats: 10^16 is exact, 10^16 - 1 is not
        low, high = ("exclusiveMinimum", -float(NUMBER_BOUND + 1)), ("exclusiveMaximum", float(NUMBER_BOUND + 1))
    elif "integer" in kinds:
        low, high = ("minimum", -NUMBER_BOUND), ("maximum", NUMBER_BOUND)
    else:
        return out
    if "minimum" not in schema and "exclusiveMinimum" not in schema:
        out[low[0]] = low[1]
    if "maximum" not in schema and "exclusiveMaximum" not in schema:
        out[high[0]] = high[1]
    return out
