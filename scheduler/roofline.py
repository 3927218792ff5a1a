"""Roofline-guided split of one KV budget between the generator and its verifier(s) (FlashTTS §4.3.1).

A round of the workload is R sequences: the verifier prefills each sequence's input of S_p tokens in
batches of B_p, the generator decodes S_d tokens for each in batches of B_d over an average context
of C tokens. One batch of a stage takes its roofline latency, max(FLOPs / peak FLOP/s, bytes / peak
bandwidth), and a round takes

    T(B_p, B_d) = ceil(R / B_p) * T_prefill(B_p) + ceil(R / B_d) * S_d * T_decode(B_d)

subject to B_p sequences of S_p tokens in every verifier store plus B_d sequences of C tokens in the
generator's pool fitting the budget, in whole blocks of each model. Latency falls as memory grows, so
the best pair lies on the memory boundary: every feasible B_p is tried with the largest B_d that fits
the rest, and the fastest pair kept; equal times go to the larger B_d (decoding is the stage that is
bound by memory), and with B_d equal too, to the larger B_p. A batch larger than R is R: there is no
more work to batch, so once B_d reaches R the generator needs no more memory, while a larger verifier
store also keeps more of its prefix cache (which the model, prefilling whole inputs, does not see).

Pure arithmetic on frozen values; no torch. The runtime builds the costs from its loaded models.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Two latencies closer than this (relative) are a tie: float rounding must not break the tie rule.
_TIE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class DevicePeaks:
    flops: float  # FLOP/s
    bandwidth: float  # bytes/s

    def __post_init__(self) -> None:
        if not (self.flops > 0 and self.bandwidth > 0 and math.isfinite(self.flops)
                and math.isfinite(self.bandwidth)):
            raise ValueError(f"device peaks must be positive and finite, got {self.flops} FLOP/s and "
                             f"{self.bandwidth} bytes/s")

    def latency(self, flops: float, num_bytes: float) -> float:
        return max(flops / self.flops, num_bytes / self.bandwidth)


@dataclass(frozen=True)
class ModelCost:
    """What one model costs per step: weights read once per forward pass, ~2 FLOPs per weight per
    token, attention FLOPs per token of context it attends to, and its KV in whole blocks."""
    weight_bytes: int
    flops_per_token: int  # 2 x the parameters a token's forward pass multiplies by
    attention_flops_per_context_token: int  # 4 x layers x query heads x head dim (QK^T and AV)
    block_bytes: int  # one KV block (all layers, keys and values)
    block_size: int  # tokens per block

    def __post_init__(self) -> None:
        if self.block_bytes <= 0 or self.block_size <= 0:
            raise ValueError(f"a KV block needs positive bytes and tokens, got {self.block_bytes} bytes "
                             f"of {self.block_size} tokens")
        if min(self.weight_bytes, self.flops_per_token, self.attention_flops_per_context_token) < 0:
            raise ValueError("model costs cannot be negative")

    @property
    def kv_bytes_per_token(self) -> float:
        return self.block_bytes / self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def prefill_latency(self, peaks: DevicePeaks, batch: int, num_tokens: int) -> float:
        """`batch` sequences of `num_tokens` each, causal: token i attends to i + 1 tokens."""
        flops = batch * (num_tokens * self.flops_per_token
                         + self.attention_flops_per_context_token * num_tokens * (num_tokens + 1) // 2)
        num_bytes = self.weight_bytes + batch * num_tokens * self.kv_bytes_per_token  # KV written
        return peaks.latency(flops, num_bytes)

    def decode_latency(self, peaks: DevicePeaks, batch: int, context_tokens: int) -> float:
        """One token for each of `batch` sequences reading `context_tokens` of KV each."""
        flops = batch * (self.flops_per_token + self.attention_flops_per_context_token * context_tokens)
        num_bytes = self.weight_bytes + batch * context_tokens * self.kv_bytes_per_token
        return peaks.latency(flops, num_bytes)


@dataclass(frozen=True)
class Workload:
    num_sequences: int  # R: sequences (search paths) per round
    verifier_input_tokens: int  # S_p: one sequence's verifier input
    generation_tokens: int  # S_d: tokens each sequence decodes per round
    avg_context_tokens: int  # C: average KV length while decoding

    def __post_init__(self) -> None:
        if min(self.num_sequences, self.verifier_input_tokens, self.generation_tokens,
               self.avg_context_tokens) < 1:
            raise ValueError(f"every workload figure must be >= 1: {self}")


@dataclass(frozen=True)
class KVSplit:
    """The chosen batch sizes, the blocks (and bytes) each model's pool gets, the predicted round."""
    prefill_batch: int  # B_p: verifier sequences prefilled together
    decode_batch: int  # B_d: generator sequences decoded together
    generator_blocks: int
    generator_bytes: int
    verifier_blocks: tuple[int, ...]  # one entry per verifier, in the order given
    verifier_bytes: tuple[int, ...]
    prefill_seconds: float  # ceil(R / B_p) * T_prefill(B_p)
    decode_seconds: float  # ceil(R / B_d) * S_d * T_decode(B_d)

    @property
    def predicted_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds


def prefill_seconds(verifiers: Sequence[ModelCost], workload: Workload, peaks: DevicePeaks, batch: int) -> float:
    """The round's verifier stage; with several verifiers, the slowest sets it (any may be asked)."""
    rounds = -(-workload.num_sequences // batch)
    return rounds * max(v.prefill_latency(peaks, batch, workload.verifier_input_tokens) for v in verifiers)


def decode_seconds(generator: ModelCost, workload: Workload, peaks: DevicePeaks, batch: int) -> float:
    rounds = -(-workload.num_sequences // batch)
    return rounds * workload.generation_tokens * generator.decode_latency(peaks, batch, workload.avg_context_tokens)


def choose_split(budget_bytes: int, generator: ModelCost, verifiers: Sequence[ModelCost], workload: Workload,
                 peaks: DevicePeaks) -> KVSplit:
    """The paper's linear search over B_p on the memory boundary of one budget shared by the generator
    and every verifier store (each store holds B_p verifier sequences, since any verifier may be the
    one asked). The generator gets every whole block the verifiers leave, not only B_d sequences'."""
    verifiers = tuple(verifiers)
    if not verifiers:
        raise ValueError("a KV split needs at least one verifier")
    prefill_unit = sum(v.blocks_for(workload.verifier_input_tokens) * v.block_bytes for v in verifiers)
    decode_unit = generator.blocks_for(workload.avg_context_tokens) * generator.block_bytes
    if budget_bytes < prefill_unit + decode_unit:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes cannot hold one verifier input of "
            f"{workload.verifier_input_tokens} tokens ({prefill_unit} bytes over the verifier stores) and "
            f"one generator sequence of {workload.avg_context_tokens} tokens ({decode_unit} bytes)")
    best: tuple[float, int, int, float, float] | None = None  # (seconds, B_p, B_d, prefill, decode)
    max_prefill = min(workload.num_sequences, (budget_bytes - decode_unit) // prefill_unit)
    for batch_p in range(1, max_prefill + 1):
        batch_d = min(workload.num_sequences, (budget_bytes - batch_p * prefill_unit) // decode_unit)
        prefill = prefill_seconds(verifiers, workload, peaks, batch_p)
        decode = decode_seconds(generator, workload, peaks, batch_d)
        if best is None or _is_better(prefill + decode, batch_d, best[0], best[2]):
            best = (prefill + decode, batch_p, batch_d, prefill, decode)
    assert best is not None
    _, batch_p, batch_d, prefill, decode = best
    verifier_blocks = tuple(batch_p * v.blocks_for(workload.verifier_input_tokens) for v in verifiers)
    verifier_bytes = tuple(n * v.block_bytes for n, v in zip(verifier_blocks, verifiers))
    generator_blocks = (budget_bytes - sum(verifier_bytes)) // generator.block_bytes
    return KVSplit(batch_p, batch_d, generator_blocks, generator_blocks * generator.block_bytes,
                   verifier_blocks, verifier_bytes, prefill, decode)


def _is_better(seconds: float, batch_d: int, best_seconds: float, best_batch_d: int) -> bool:
    """Faster wins; a tie (within float rounding) goes to the larger B_d, and with B_d equal to the
    later pair, whose B_p is larger (B_p is tried in ascending order)."""
    if seconds < best_seconds * (1 - _TIE_TOLERANCE):
        return True
    return seconds <= best_seconds * (1 + _TIE_TOLERANCE) and batch_d >= best_batch_d


@dataclass(frozen=True)
class BatchCaps:
    """Batch sizes for the load now, inside pools sized earlier, and what they cap."""
    prefill_batch: int
    decode_batch: int
    generator_blocks: int  # blocks the generator's sequences of one round may hold at once
    verifier_tokens_per_step: int  # prefill tokens one verifier step may take
    prefill_seconds: float
    decode_seconds: float

    @property
    def predicted_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds


def choose_batches(generator_blocks: int, verifier_blocks: Sequence[int], generator: ModelCost,
                   verifiers: Sequence[ModelCost], workload: Workload, peaks: DevicePeaks) -> BatchCaps:
    """The same objective over what fixed pools allow: the stages no longer compete for memory, so
    each batch size is chosen alone, each at most R and what its pool holds of the workload's
    sequences. Ties go to the larger batch of each, as at start-up: the model prefills whole inputs,
    but with the verifier's prefix cache a step prefills far fewer tokens, where one weight read
    for many sequences is what batching buys."""
    verifiers = tuple(verifiers)
    if not verifiers or len(verifiers) != len(verifier_blocks):
        raise ValueError("one pool size is needed per verifier, and at least one verifier")
    fit_p = min(n // v.blocks_for(workload.verifier_input_tokens) for n, v in zip(verifier_blocks, verifiers))
    per_sequence = generator.blocks_for(workload.avg_context_tokens)
    fit_d = generator_blocks // per_sequence
    if fit_p < 1 or fit_d < 1:
        raise ValueError(f"the pools ({generator_blocks} generator blocks, {tuple(verifier_blocks)} verifier "
                         f"blocks) cannot hold one sequence of the workload {workload}")
    best_p = min(range(1, min(fit_p, workload.num_sequences) + 1),
                 key=lambda b: (_rounded(prefill_seconds(verifiers, workload, peaks, b)), -b))
    best_d = min(range(1, min(fit_d, workload.num_sequences) + 1),
                 key=lambda b: (_rounded(decode_seconds(generator, workload, peaks, b)), -b))
    return BatchCaps(best_p, best_d, best_d * per_sequence, best_p * workload.verifier_input_tokens,
                     prefill_seconds(verifiers, workload, peaks, best_p),
                     decode_seconds(generator, workload, peaks, best_d))


def _rounded(seconds: float) -> float:
    """Latencies equal but for float rounding compare equal, so the tie rules decide."""
    return float(f"{seconds:.9g}")
