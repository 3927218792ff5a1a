"""Token sampling with per-sequence parameters and per-sequence random generators.

Every sequence draws from its own seeded `torch.Generator`, one draw per sampled token, so the
tokens a seed gives do not depend on which other sequences share the batch or on preemption.
Log-probabilities are reported from the model's own distribution (before penalties/temperature).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch

from runtime.protocol import SamplingParams


def derive_seed(seed: int | None, *path: int) -> int:
    """A 63-bit seed for one sequence: the request seed (or fresh entropy) and its position in the request."""
    material = os.urandom(8) if seed is None else seed.to_bytes(16, "little", signed=True)
    h = hashlib.blake2b(material, digest_size=8)
    for part in path:
        h.update(part.to_bytes(8, "little", signed=True))
    return int.from_bytes(h.digest(), "little") >> 1


# Below this, dividing float32 logits by the temperature can overflow; such requests decode greedily.
MIN_TEMPERATURE = 1e-5


@dataclass
class SampleOutput:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


class SamplingState:
    """What sampling needs to remember about one sequence."""

    def __init__(self, params: SamplingParams, seed: int, device: torch.device, track_logprobs: bool = False) -> None:
        self.params = params
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # Report the sampled token's log-probability even when the client did not ask (search scoring).
        self.wants_logprob = params.logprobs or track_logprobs


def _apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        if len(seen):
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output_ids:
        ids = torch.tensor(output_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(ids, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Top-k, then top-p, then min-p, on temperature-scaled logits; removed entries become -inf."""
    if p.top_k and p.top_k > 0 and p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        remove = torch.cumsum(probs, dim=-1) - probs >= p.top_p
        remove[0] = False  # a top_p that is 0.0 in float32 would otherwise remove every token
        logits = logits.scatter(0, order, sorted_logits.masked_fill(remove, float("-inf")))
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def sample(logits: torch.Tensor, states: list[SamplingState], token_histories: list[tuple[list[int], list[int]]]) -> list[SampleOutput]:
    """Sample one token per row of `logits` `[S, vocab]` (float32).

    `token_histories[i]` is (prompt ids, output ids) of row i, for the penalties. Rows are processed
    together; each sampled row takes exactly one uniform draw from its own generator and inverts
    its cumulative distribution, so a row's token does not depend on the other rows.
    """
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(s.wants_logprob for s in states) else None
    x = logits
    penalised = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0
                 or s.params.presence_penalty or s.params.frequency_penalty]
    if penalised:
        x = logits.clone()
        for row in penalised:
            x[row] = _apply_penalties(x[row], states[row].params, *token_histories[row])
    tokens = torch.argmax(x, dim=-1).tolist()
    rows = [i for i, s in enumerate(states) if not s.params.is_greedy and s.params.temperature >= MIN_TEMPERATURE]
    if rows:
        temperatures = torch.tensor([states[i].params.temperature for i in rows], dtype=x.dtype, device=x.device)
        y = x[rows] / temperatures[:, None]
        overflow = torch.isposinf(y)
        if overflow.any():
            # Overflowed (a tiny repetition penalty): in the limit those tokens hold all the mass.
            hit = overflow.any(dim=-1, keepdim=True)
            y = torch.where(hit, torch.where(overflow, 0.0, float("-inf")), y)
        for k, row in enumerate(rows):
            p = states[row].params
            if (p.top_k and p.top_k > 0) or p.top_p < 1.0 or p.min_p > 0.0:
                y[k] = _filter(y[k], p)
        cdf = torch.softmax(y, dim=-1).cumsum_(dim=-1)
        draws = torch.stack([torch.rand((), generator=states[row].generator, dtype=cdf.dtype) for row in rows])
        picked = torch.searchsorted(cdf, (draws * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        picked = picked.clamp_(max=cdf.shape[-1] - 1).tolist()
        for k, row in enumerate(rows):
            tokens[row] = picked[k]
    outputs: list[SampleOutput] = []
    for row, (state, token) in enumerate(zip(states, tokens)):
        out = SampleOutput(token)
        if state.wants_logprob and raw_logprobs is not None:
            lp = raw_logprobs[row]
            out.logprob = float(lp[token])
            if state.params.top_logprobs > 0:
                values, ids = torch.topk(lp, state.params.top_logprobs)
                out.top = [(int(i), float(v)) for i, v in zip(ids, values)]
        outputs.append(out)
    return outputs

