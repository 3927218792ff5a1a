"""Token sampling with per-sequence parameters and per-sequence random generators.

Every sequence draws from its own seeded `torch.Generator`, one draw per sampled token, so the
tokens a seed gives do not depend on which other sequences share the batch or on preemption. On a CUDA
device the draws are keyed instead: each row's uniform is Philox4x32-10 of (its seed, its output
position) (runtime.model.philox), all rows in a few elementwise operators on the device, with no
per-row generator call; the same independence holds, and a recomputed token draws what it drew.
Log-probabilities are reported from the model's own distribution (before penalties/temperature).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch

from runtime.kernels.cpu_kernels import loaded_argmax
from runtime.model.philox import uniforms
from runtime.wire.params import SamplingParams


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
    # -mean of the `confidence_k` most likely tokens' log-probabilities (DeepConf's token confidence)
    confidence: float | None = None


class SamplingState:
    """What sampling needs to remember about one sequence."""

    def __init__(self, params: SamplingParams, seed: int, device: torch.device, track_logprobs: bool = False,
                 confidence_k: int = 0, constraint=None) -> None:
        self.params = params
        self.seed = seed  # the key of the keyed draws (on a CUDA device, see `sample`)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # Report the sampled token's log-probability even when the client did not ask (search scoring).
        self.wants_logprob = params.logprobs or track_logprobs or confidence_k > 0
        self.confidence_k = confidence_k  # > 0: report each token's confidence over this many top tokens
        # Its grammar's place (runtime.grammar.matcher.TokenConstraint), or None: the engine turns it into
        # the `allowed` mask `sample` takes and hands it each sampled token; the sampler never reads it.
        self.constraint = constraint


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


def _uniform(state: SamplingState, dtype: torch.dtype) -> torch.Tensor:
    """One draw in [0, 1) from the sequence's generator, made on the generator's own device."""
    return torch.rand((), generator=state.generator, device=state.generator.device, dtype=dtype)


def sample(logits: torch.Tensor, states: list[SamplingState], token_histories: list[tuple[list[int], list[int]]],
           refused: tuple[list[int], torch.Tensor] | None = None, keyed: bool | None = None) -> list[SampleOutput]:
    """Sample one token per row of `logits` `[S, vocab]` (float32).

    `token_histories[i]` is (prompt ids, output ids) of row i, for the penalties. `refused`: (rows,
    [len(rows), vocab] booleans) the tokens each of those rows' grammar refuses; they become -inf
    after the penalties and logit bias, so a greedy row takes the best allowed token and a sampled row
    draws among them (log-probabilities stay the model's own). Rows are processed
    together; each sampled row takes exactly one uniform draw from its own generator and inverts
    its cumulative distribution, so a row's token does not depend on the other rows (`keyed`, by default
    on a CUDA device: that draw is Philox of the row's seed and output position, runtime.model.philox). Tokens,
    log-probabilities and top log-probabilities of every row come to the host in one transfer.
    """
    device = logits.device
    wants = [i for i, s in enumerate(states) if s.wants_logprob]
    x = logits
    penalised = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0
                 or s.params.presence_penalty or s.params.frequency_penalty]
    biased = [i for i, s in enumerate(states) if s.params.logit_bias]
    if penalised or biased or refused is not None:
        x = logits.clone()
        for row in penalised:
            x[row] = _apply_penalties(x[row], states[row].params, *token_histories[row])
        for row in biased:
            ids, bias = zip(*states[row].params.logit_bias)
            x[row, list(ids)] += torch.tensor(bias, dtype=x.dtype, device=x.device)
        if refused is not None:
            masked, mask = refused
            if len(masked) == len(states):  # every row: in place
                x.masked_fill_(mask[:, :x.shape[-1]], float("-inf"))
            else:
                x[masked] = x[masked].masked_fill(mask[:, :x.shape[-1]], float("-inf"))
    rows = [i for i, s in enumerate(states) if not s.params.is_greedy and s.params.temperature >= MIN_TEMPERATURE]
    # Greedy rows take the argmax; when every row samples, the sampled tokens fill `tokens` below.
    tokens = _argmax(x) if len(rows) < len(states) else torch.empty(len(states), dtype=torch.long, device=device)
    if rows:
        temperatures = torch.tensor([states[i].params.temperature for i in rows], dtype=x.dtype, device=device)
        y = (x if len(rows) == len(states) else x[rows]) / temperatures[:, None]
        if penalised or biased:  # finite logits over a temperature >= MIN_TEMPERATURE cannot overflow without them
            # Overflowed (a tiny repetition penalty): in the limit those tokens hold all the mass.
            overflow = torch.isposinf(y)
            hit = overflow.any(dim=-1, keepdim=True)
            y = torch.where(hit, torch.where(overflow, 0.0, float("-inf")), y)
        for k, row in enumerate(rows):
            p = states[row].params
            if (p.top_k and p.top_k > 0) or p.top_p < 1.0 or p.min_p > 0.0:
                y[k] = _filter(y[k], p)
        cdf = torch.softmax(y, dim=-1).cumsum_(dim=-1)
        if keyed if keyed is not None else device.type == "cuda":
            seeds = torch.tensor([states[row].seed for row in rows], dtype=torch.int64)
            positions = torch.tensor([len(token_histories[row][1]) for row in rows], dtype=torch.int64)
            draws = uniforms(torch.stack((seeds, positions)).to(device))
        else:
            draws = torch.stack([_uniform(states[row], cdf.dtype).to(device) for row in rows])
        picked = torch.searchsorted(cdf, (draws * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        tokens[torch.tensor(rows, device=device)] = picked.clamp_(max=cdf.shape[-1] - 1)
    # One transfer: token ids, then per row wanting them its log-probability and top-k (values, ids),
    # all exact in float64 (ids are integers below 2**53, log-probabilities float32).
    parts = [tokens.to(torch.float64)]
    top_k = max((states[i].params.top_logprobs for i in wants), default=0)
    confident = [j for j, i in enumerate(wants) if states[i].confidence_k > 0]
    if wants:
        want_t = torch.tensor(wants, device=device)
        raw_logprobs = torch.log_softmax(logits[want_t], dim=-1)
        parts.append(raw_logprobs.gather(1, tokens[want_t, None]).flatten().to(torch.float64))
        if top_k:
            values, ids = torch.topk(raw_logprobs, top_k, dim=-1)
            parts += [values.flatten().to(torch.float64), ids.flatten().to(torch.float64)]
        if confident:  # each row's own top-k: a row's confidence does not depend on the others
            conf_k = max(states[wants[j]].confidence_k for j in confident)
            top = torch.topk(raw_logprobs[confident], min(conf_k, raw_logprobs.shape[-1]), dim=-1).values
            ks = torch.tensor([min(states[wants[j]].confidence_k, top.shape[-1]) for j in confident], device=device)
            keep = torch.arange(top.shape[-1], device=device)[None, :] < ks[:, None]
            kept = torch.where(keep, top.to(torch.float64), torch.zeros((), dtype=torch.float64, device=device))
            parts.append(-kept.sum(dim=-1) / ks)
    host = _to_host(torch.cat(parts))
    n, w = len(states), len(wants)
    outputs = [SampleOutput(int(t)) for t in host[:n]]
    for j, row in enumerate(wants):
        out = outputs[row]
        out.logprob = host[n + j]
        count = states[row].params.top_logprobs
        if count > 0:
            values = host[n + w + j * top_k:n + w + j * top_k + count]
            ids = host[n + w + w * top_k + j * top_k:n + w + w * top_k + j * top_k + count]
            out.top = [(int(i), v) for i, v in zip(ids, values)]
    for j, value in zip(confident, host[len(host) - len(confident):]):
        outputs[wants[j]].confidence = value
    return outputs


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax over each row of `x`: on the CPU through ponder's kernel where it is loaded (a row
    a thread, vectorized: torch's took 0.6 ms a step of 16 rows of a 49k vocabulary), the same index."""
    op = loaded_argmax() if x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1 else None
    return torch.argmax(x, dim=-1) if op is None or x.shape[-1] == 0 else op(x)


def _to_host(values: torch.Tensor) -> list[float]:
    """`values` as a list: on a CUDA device one copy into pinned host memory (torch's caching host
    allocator keeps the pages from step to step), then a wait for the stream up to that copy."""
    if values.device.type != "cuda":
        return values.tolist()
    pinned = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    pinned.copy_(values, non_blocking=True)
    torch.cuda.current_stream(values.device).synchronize()
    return pinned.tolist()


@dataclass
class ScoredToken:
    """A prompt token's log-probability and rank (1: most likely) at its position, and the top (id, logprob)."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


SCORE_ROWS = 256  # rows of a prompt's logits scored at once: bounds the float32 [rows, vocab] temporaries


def score_tokens(logits: torch.Tensor, targets: list[int], top_k: int) -> list[ScoredToken]:
    """Row i of `logits` `[R, vocab]` scores `targets[i]`: its log-softmax value, its rank (one plus the
    tokens strictly more likely) and the `top_k` most likely tokens. One transfer per SCORE_ROWS rows."""
    out = []
    for start in range(0, len(targets), SCORE_ROWS):
        out += _score_rows(logits[start:start + SCORE_ROWS], targets[start:start + SCORE_ROWS], top_k)
    return out


def _score_rows(logits: torch.Tensor, targets: list[int], top_k: int) -> list[ScoredToken]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top_k = min(top_k, logprobs.shape[-1])
    target_t = torch.tensor(targets, device=logits.device, dtype=torch.long)[:, None]
    chosen = logprobs.gather(1, target_t)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    parts = [chosen.flatten().to(torch.float64), ranks.to(torch.float64)]
    if top_k:
        values, ids = torch.topk(logprobs, top_k, dim=-1)
        parts += [values.flatten().to(torch.float64), ids.flatten().to(torch.float64)]
    host = torch.cat(parts).tolist()
    r = len(targets)
    out = []
    for i in range(r):
        values = host[2 * r + i * top_k:2 * r + (i + 1) * top_k]
        ids = host[2 * r + r * top_k + i * top_k:2 * r + r * top_k + (i + 1) * top_k]
        out.append(ScoredToken(host[i], int(host[r + i]), [(int(t), v) for t, v in zip(ids, values)]))
    return out
