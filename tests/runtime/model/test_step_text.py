"""StepText: a step's text decoded incrementally equals decoding the step's tokens whole."""

import random

from runtime.model.detokenizer import StepText
from tests.runtime.conftest import build_tokenizer


def test_incremental_step_text_equals_a_whole_decode_after_every_token():
    tokenizer = build_tokenizer()
    rng = random.Random(0)
    # Ids of every kind: byte tokens that split a character, merges, special tokens (skipped).
    multibyte = tokenizer.encode("é ки → Yes", add_special_tokens=False)
    pool = list(range(len(tokenizer))) + multibyte * 20
    for trial in range(40):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 60))]
        start = rng.randint(0, len(ids) - 1)
        step = StepText(tokenizer, start)
        for end in range(start + 1, len(ids) + 1):
            whole = tokenizer.decode(ids[start:end], skip_special_tokens=True)
            assert step.text(ids[:end]) == whole, (trial, ids[start:end])
