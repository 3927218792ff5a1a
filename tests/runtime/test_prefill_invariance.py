"""With batch invariance on, a prompt's first token and its log-probabilities are the same bits
whether the prompt was computed cold, partly found in the prefix cache, or prefilled in chunks."""

from runtime.wire.protocol import Delta, Finished
from tests.runtime.engine_helpers import engine_for, request

PROMPT = [1] + [5 + (7 * i) % 40 for i in range(37)]  # 38 tokens: 9 full blocks of 4 and a partial one


def generate(engine, prompt, request_id):
    """(token ids, each token's log-probability, its top-5 log-probabilities, cached prompt tokens)."""
    engine.add_request(request(request_id, prompt, max_tokens=6, logprobs=True, top_logprobs=5))
    tokens, logprobs, tops, cached = [], [], [], None
    while engine.has_work:
        for message in engine.step():
            if isinstance(message, Delta) and message.request_id == request_id:
                tokens.extend(message.token_ids)
                for entry in message.logprobs or ():
                    logprobs.append(entry.logprob)
                    tops.append([(t.token, t.logprob) for t in entry.top])
            elif isinstance(message, Finished) and message.request_id == request_id:
                cached = message.cached_tokens
    return tokens, logprobs, tops, cached


def test_a_cached_prefix_gives_the_bits_of_a_cold_prompt(tiny_llama):
    cold = generate(engine_for(tiny_llama), PROMPT, "cold")
    assert cold[3] == 0
    for prefix in (4, 17, 36):  # whole blocks, a block and a bit, all but the last two tokens
        engine = engine_for(tiny_llama)
        generate(engine, PROMPT[:prefix] + [3, 3, 3, 3, 3], "warm-up")  # leaves the prefix's blocks cached
        warm = generate(engine, PROMPT, f"warm-{prefix}")
        assert warm[3] == prefix // 4 * 4 > 0
        assert warm[:3] == cold[:3], prefix


def test_chunked_prefill_gives_the_bits_of_one_chunk(tiny_llama):
    whole = generate(engine_for(tiny_llama), PROMPT, "whole")
    for chunk in (4, 8, 12):
        chunked = generate(engine_for(tiny_llama, max_num_batched_tokens=chunk), PROMPT, f"chunks-{chunk}")
        assert chunked[:3] == whole[:3], chunk


def test_without_batch_invariance_prompts_are_prefilled_in_one_attention_call(tiny_llama):
    engine = engine_for(tiny_llama, batch_invariant=False)
    assert not engine.runner.exact_prefill
    assert engine_for(tiny_llama).runner.exact_prefill
