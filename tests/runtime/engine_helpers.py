"""Drive an Engine directly (no processes) and compare with transformers."""

from __future__ import annotations

import torch

from runtime.bootstrap import build_engine
from runtime.wire.params import SamplingParams
from runtime.wire.protocol import Accepted, Delta, Finished, GenerateRequest, RequestError
from runtime.wire.options import RuntimeOptions


def engine_for(path, **options):
    # Batch invariance on: the tests compare results across schedules, batches and pools bit for bit.
    defaults = dict(model=str(path), device="cpu", num_blocks=128, block_size=4, batch_invariant=True)
    defaults.update(options)
    engine, _ = build_engine(RuntimeOptions(**defaults))
    return engine


def request(request_id, prompt_ids, **sampling):
    params = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    params.update(sampling)
    return GenerateRequest(request_id=request_id, endpoint="completion", prompt_token_ids=tuple(prompt_ids),
                           sampling=SamplingParams(**params))


def run(engine, requests, check=True):
    """Add all requests, step until idle; returns {request_id: {"choices": {index: ids}, "finished": msg}}."""
    results = {}
    for req in requests:
        out = engine.add_request(req)
        assert isinstance(out[0], Accepted), out
        results[req.request_id] = {"choices": {}, "text": {}, "finished": None, "finish_reasons": {}}
    while engine.has_work:
        for message in engine.step():
            if isinstance(message, Delta):
                r = results[message.request_id]
                r["choices"].setdefault(message.index, []).extend(message.token_ids)
                r["text"][message.index] = r["text"].get(message.index, "") + message.text
                if message.finish_reason:
                    r["finish_reasons"][message.index] = message.finish_reason
            elif isinstance(message, Finished):
                results[message.request_id]["finished"] = message
            elif isinstance(message, RequestError):
                raise AssertionError(message)
        if check:
            engine.check_integrity()
    return results


def hf_greedy(model, prompt_ids, max_new_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
