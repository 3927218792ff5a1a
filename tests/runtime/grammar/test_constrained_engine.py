"""Constrained decoding in the engine, on a tiny model over a byte-level BPE tokenizer: greedy tokens
equal a reference that applies llguidance's own mask to transformers' logits step by step; sampled
outputs validate; a seed gives the same constrained tokens whatever shares the batch; logit_bias
removes and forces tokens; a search's paths all keep to the grammar."""

from __future__ import annotations

import json

import jsonschema
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
import torch
from llguidance import LLMatcher

from runtime.grammar.compiler import JSON_STYLE
from runtime.wire.params import Constraint, SamplingParams, SearchParams, ToolCalling
from runtime.wire.protocol import Accepted, GenerateRequest
from tests.runtime.engine_helpers import engine_for

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "size": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
    "required": ["name", "tags", "size"], "additionalProperties": False}
PROMPT = [1, 520, 3714, 28, 2]


def wait_for(engine, req: GenerateRequest) -> list:
    """Add `req` and wait until its grammar compiled and it was admitted: the messages of the steps
    taken meanwhile (its Accepted first, then perhaps its first token)."""
    out = engine.add_request(req)
    while not out:
        out = engine.step()
    assert isinstance(out[0], Accepted) and out[0].request_id == req.request_id, out
    return out


def constrained(request_id: str, constraint=None, tools=None, prompt=PROMPT, **sampling) -> GenerateRequest:
    params = dict(max_tokens=48, temperature=0.0)
    params.update(sampling)
    return GenerateRequest(request_id=request_id, endpoint="completion", prompt_token_ids=tuple(prompt),
                           sampling=SamplingParams(**params), constraint=constraint, tools=tools)


def collect(engine, requests):
    """Run `requests` (admitted as their grammars compile) to the end: {request id: {index: token ids}}."""
    tokens: dict[str, dict[int, list[int]]] = {r.request_id: {} for r in requests}

    def take(messages) -> None:
        for message in messages:
            ids = getattr(message, "token_ids", None)
            if ids is not None and hasattr(message, "index"):
                tokens[message.request_id].setdefault(message.index, []).extend(ids)

    for req in requests:
        take(wait_for(engine, req))
    while engine.has_work:
        take(engine.step())
        engine.check_integrity()
    return tokens


@pytest.fixture(scope="module")
def engine(bpe_llama):
    return engine_for(bpe_llama, num_blocks=256, block_size=16, max_model_len=1024)


@pytest.fixture(scope="module")
def hf_model(bpe_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bpe_llama, dtype=torch.float32).eval()


def reference_greedy(model, tokenizer, grammar: str, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    """transformers' logits, llguidance's own mask (its numpy helpers), argmax, token by token."""
    matcher = LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=eos), grammar)
    ids, out = list(prompt), []
    bitmask = llguidance.numpy.allocate_token_bitmask(1, len(tokenizer))
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float().numpy().copy()[None, :]
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        llguidance.numpy.apply_token_bitmask_inplace(logits, bitmask)
        token = int(np.argmax(logits[0]))
        out.append(token)
        if token == eos:
            break
        assert matcher.consume_token(token)
        ids.append(token)
    return out


@pytest.mark.parametrize("constraint", [
    Constraint(kind="json_schema", spec=json.dumps(SCHEMA)),
    Constraint(kind="regex", spec="(cat|dog)s? [0-9]{2,4}!"),
])
def test_greedy_masked_tokens_equal_the_library_s_mask_on_transformers_logits(engine, hf_model, smollm_tokenizer,
                                                                                   constraint):
    tokens = collect(engine, [constrained("ref", constraint)])["ref"][0]
    text, _ = engine.gate.grammars.key(constraint, None)
    expected = reference_greedy(hf_model, smollm_tokenizer, text, PROMPT, 48, 2)
    assert tokens == expected  # the EOS it stops on included, as in every Delta
    assert tokens  # the model wrote something under the mask


def test_sampled_choices_validate_and_a_seed_is_batch_invariant(engine, smollm_tokenizer):
    constraint = Constraint(kind="json_schema", spec=json.dumps(SCHEMA))
    alone = collect(engine, [constrained("alone", constraint, n=3, temperature=1.0, seed=7, max_tokens=96)])["alone"]
    others = [constrained(f"other{i}", None, prompt=PROMPT[:3 + i], temperature=1.0, seed=i, max_tokens=30)
              for i in range(3)]
    beside = collect(engine, [*others, constrained("beside", constraint, n=3, temperature=1.0, seed=7,
                                                   max_tokens=96)])["beside"]
    assert beside == alone
    texts = [smollm_tokenizer.decode(ids, skip_special_tokens=True) for ids in alone.values()]
    assert len(set(texts)) > 1  # sampling, not three copies
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_logit_bias_removes_and_forces_tokens(engine):
    free = collect(engine, [constrained("free", None, max_tokens=6)])["free"][0]
    banned = collect(engine, [constrained("banned", None, max_tokens=6, logit_bias=((free[0], -100.0),))])["banned"][0]
    assert banned[0] != free[0] and free[0] not in banned
    forced = collect(engine, [constrained("forced", None, max_tokens=6, logit_bias=((777, 100.0),))])["forced"][0]
    assert forced == [777] * 6


def test_a_search_keeps_every_path_to_the_grammar_and_votes_on_parsed_json(engine, smollm_tokenizer):
    constraint = Constraint(kind="json_schema", spec=json.dumps(SCHEMA))
    req = GenerateRequest(request_id="search", endpoint="completion", prompt_token_ids=tuple(PROMPT),
                          sampling=SamplingParams(max_tokens=96, temperature=1.0, seed=3, n=4),
                          search=SearchParams(strategy="beam", n=8, beam_width=2, max_step_tokens=16,
                                              verifier="confidence", select="majority"),
                          constraint=constraint)
    finals = [m for m in wait_for(engine, req) if getattr(m, "finish_reason", None) is not None]
    while engine.has_work:
        for message in engine.step():
            if getattr(message, "finish_reason", None) is not None:
                finals.append(message)
        engine.check_integrity()
    assert len(finals) == 4
    for delta in finals:
        text = smollm_tokenizer.decode(list(delta.token_ids), skip_special_tokens=True)
        if delta.finish_reason == "stop":
            value = json.loads(text)
            jsonschema.validate(value, SCHEMA)
            assert delta.search.answer == json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def test_tools_required_give_a_valid_call(engine, smollm_tokenizer):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}}}
    req = GenerateRequest(request_id="tools", endpoint="chat",
                          messages=({"role": "user", "content": "Weather in Paris?"},),
                          sampling=SamplingParams(max_tokens=64, temperature=0.0),
                          tools=ToolCalling(tools=(weather,), choice="required", parallel=False))
    ids = collect(engine, [req])["tools"][0]
    from runtime.wire.tool_calls import parse_tool_calls

    _, calls = parse_tool_calls(smollm_tokenizer.decode(ids, skip_special_tokens=True), "hermes")
    assert [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), weather["function"]["parameters"])


def test_json_style_is_what_the_compiler_writes():
    assert JSON_STYLE == {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def test_a_compiling_grammar_holds_its_request_and_no_other(engine):
    """While a grammar compiles (a future the test holds), other requests run to the end; the held one
    is admitted, Accepted before its first token, once its grammar is there; an abort forgets it."""
    from concurrent.futures import Future

    constraint = Constraint(kind="regex", spec="(held|kept) [0-9]{4}")
    text, param = engine.gate.grammars.key(constraint, None)
    engine.gate.grammars.cache.pop(text, None)
    pending: Future = Future()
    submitted = []
    real_submit = engine.gate.grammars.submit
    engine.gate.grammars.submit = lambda t, p: submitted.append(t) or pending
    try:
        assert engine.add_request(constrained("held", constraint)) == []
        assert engine.add_request(constrained("gone", Constraint(kind="regex", spec="x+y"))) == []
        engine.abort("gone")
        assert isinstance(engine.add_request(constrained("other", None, max_tokens=5))[0], Accepted)
        other, ended = [], False
        while not ended:  # the engine has work all along: the held request
            for message in engine.step():
                assert message.request_id == "other"
                other += list(getattr(message, "token_ids", ()))
                ended = ended or getattr(message, "finish_reason", None) is not None
        assert len(other) == 5 and submitted == [text, engine.gate.grammars.key(
            Constraint(kind="regex", spec="x+y"), None)[0]]
        assert engine.has_work and "held" not in engine.requests
        pending.set_result(engine.gate.grammars._compile(text, param))
        first = engine.step()
        assert isinstance(first[0], Accepted) and first[0].request_id == "held"
        tokens = list(first[1].token_ids) if len(first) > 1 else []
        while engine.has_work:
            for message in engine.step():
                assert getattr(message, "request_id", "held") == "held"  # "gone" never comes back
                tokens += list(getattr(message, "token_ids", ()))
        assert engine.tokenizer.decode(tokens, skip_special_tokens=True).split(" ")[0] in ("held", "kept")
    finally:
        engine.gate.grammars.submit = real_submit


def test_preemption_keeps_each_choice_s_place_in_its_grammar(engine, bpe_llama, smollm_tokenizer):
    """A pool too small for three choices at once preempts and recomputes them; the tokens (and so each
    matcher's place) are the same as in a pool that holds them all."""
    long = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                       "minItems": 40}}, "required": ["notes"]}
    constraint = Constraint(kind="json_schema", spec=json.dumps(long))  # cannot end within 80 tokens
    roomy = collect(engine, [constrained("roomy", constraint, n=3, temperature=1.0, seed=9, max_tokens=80)])["roomy"]
    small = engine_for(bpe_llama, num_blocks=12, block_size=16, max_model_len=1024)
    tight = collect(small, [constrained("tight", constraint, n=3, temperature=1.0, seed=9, max_tokens=80)])["tight"]
    assert small.stats["preemptions"] > 0
    assert tight == roomy
