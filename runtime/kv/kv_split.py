"""The roofline KV split for loaded models: the pool sizes chosen at start-up, batch caps on load changes.

With `[cache] kv_split = "roofline"`, the generator's KV memory and every reward model's KV memory
are one budget. At start-up the split is chosen for DEFAULT_WORKLOAD (scheduler.roofline) and the
pools are allocated once at that size. Pools are preallocated tensors and never resized: when the
load changes, `rechoose` picks the batch sizes the roofline model prefers inside them, as two caps:
the blocks the generator's search paths of one round may hold at once, and the prefill tokens one
verifier step may take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kv.device_profile import measure_bandwidth, measure_flops
from storage.kv_cache import kv_shape_of
from runtime.model.quantize import QuantizedLinear
from scheduler.roofline import BatchCaps, DevicePeaks, KVSplit, ModelCost, Workload, choose_batches, choose_split

# The load the start-up split is chosen for: 16 search paths (beam search n=16, or two searches of
# 8), each in its fifth step. Paths hold a 256-token prompt and four steps of 128 tokens, decode
# the fifth (128 tokens over an average context of 768 + 64), and the verifier then scores the
# prompt and all five steps (896 tokens).
DEFAULT_PATHS = 16
DEFAULT_PROMPT_TOKENS = 256
DEFAULT_STEP_TOKENS = 128
DEFAULT_STEPS_DONE = 4


def default_workload(max_model_len: int) -> Workload:
    """DEFAULT_WORKLOAD, its lengths cut to what the generator's context can hold."""
    done = DEFAULT_PROMPT_TOKENS + DEFAULT_STEPS_DONE * DEFAULT_STEP_TOKENS
    return Workload(num_sequences=DEFAULT_PATHS,
                    verifier_input_tokens=min(done + DEFAULT_STEP_TOKENS, max_model_len),
                    generation_tokens=min(DEFAULT_STEP_TOKENS, max_model_len),
                    avg_context_tokens=min(done + DEFAULT_STEP_TOKENS // 2, max_model_len))


def model_cost(model: torch.nn.Module, block_size: int, *, with_head: bool) -> ModelCost:
    """Roofline cost of a transformers model (a meta-device one works too). The input embedding is a
    row gather, not a matmul, and is left out; the output head counts only `with_head` (the generator
    samples every decoded token, the reward models read hidden states and apply their small heads to
    a few rows). A head tied to the embedding is the embedding matrix, counted once."""
    embedding = {id(p) for p in model.get_input_embeddings().parameters()}
    head_module = model.get_output_embeddings()
    head = {id(p) for p in head_module.parameters()} if head_module is not None else set()
    skip = (embedding - head) if with_head else (embedding | head)
    counted = [p for p in model.parameters() if id(p) not in skip]
    # Quantized layers keep their weights as buffers: their bytes as stored, their FLOPs as a matmul's.
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear) and (with_head or m is not head_module)]
    quantized_bytes = sum(b.numel() * b.element_size() for m in quantized for b in m.buffers())
    quantized_flops = 2 * sum(m.in_features * m.out_features for m in quantized)
    dtype = next(model.parameters()).dtype
    shape = kv_shape_of(model.config, block_size)
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return ModelCost(weight_bytes=sum(p.numel() * p.element_size() for p in counted) + quantized_bytes,
                     flops_per_token=2 * sum(p.numel() for p in counted) + quantized_flops,
                     attention_flops_per_context_token=4 * shape.num_layers * text_config.num_attention_heads
                     * shape.head_dim,
                     block_bytes=shape.bytes_per_block(dtype), block_size=block_size)


@dataclass(frozen=True)
class PeakSource:
    peaks: DevicePeaks
    flops_measured: bool
    bandwidth_measured: bool

    def describe(self) -> str:
        def origin(measured: bool) -> str:
            return "measured" if measured else "configured"
        return (f"{self.peaks.flops / 1e12:.3g} TFLOP/s ({origin(self.flops_measured)}), "
                f"{self.peaks.bandwidth / 1e9:.4g} GB/s ({origin(self.bandwidth_measured)})")


def device_peaks(peak_flops: float | None, memory_bandwidth: float | None, device: torch.device,
                 dtype: torch.dtype) -> PeakSource:
    """The configured peaks; each one left unset is measured on `device` in the model's `dtype`."""
    flops = peak_flops if peak_flops is not None else measure_flops(device, dtype)
    bandwidth = memory_bandwidth if memory_bandwidth is not None else measure_bandwidth(device)
    return PeakSource(DevicePeaks(flops, bandwidth), peak_flops is None, memory_bandwidth is None)


class KVSplitter:
    """Holds the roofline inputs and the start-up split; engine-independent (no engine state).

    The start-up split sizes the pools: `generator_blocks` for the engine, `verifier_blocks[name]`
    for each reward model's store. After that, `rechoose` gives batch caps for the load now and
    `apply` hands the verifier cap to the stores; the generator cap is for the engine's search
    scheduling to honour (see `rechoose`).
    """

    def __init__(self, budget_bytes: int, generator: ModelCost, verifiers: dict[str, ModelCost],
                 peaks: PeakSource, workload: Workload) -> None:
        self.budget_bytes = budget_bytes
        self.generator = generator
        self.verifiers = dict(verifiers)
        self.peak_source = peaks
        self.workload = workload
        self.split: KVSplit = choose_split(budget_bytes, generator, tuple(self.verifiers.values()), workload,
                                           peaks.peaks)
        self._caps: dict[tuple[int, int, int], BatchCaps] = {}

    @property
    def generator_blocks(self) -> int:
        return self.split.generator_blocks

    @property
    def verifier_blocks(self) -> dict[str, int]:
        return dict(zip(self.verifiers, self.split.verifier_blocks))

    def describe(self) -> str:
        split, load = self.split, self.workload
        verifiers = ", ".join(f"{name} {blocks} blocks ({size / 2**20:.1f} MiB)" for name, blocks, size
                              in zip(self.verifiers, split.verifier_blocks, split.verifier_bytes))
        return (f"roofline KV split of {self.budget_bytes / 2**20:.1f} MiB: generator {split.generator_blocks} "
                f"blocks ({split.generator_bytes / 2**20:.1f} MiB), verifier {verifiers}; verifier batch "
                f"{split.prefill_batch}, decode batch {split.decode_batch} for {load.num_sequences} paths "
                f"(verifier input {load.verifier_input_tokens}, {load.generation_tokens} tokens decoded over "
                f"{load.avg_context_tokens} of context): predicted {split.predicted_seconds:.4g} s a round "
                f"(verify {split.prefill_seconds:.4g} s, decode {split.decode_seconds:.4g} s); peaks "
                f"{self.peak_source.describe()}")

    def rechoose(self, num_paths: int, avg_context_tokens: int, verifier_input_tokens: int) -> BatchCaps:
        """Batch caps for `num_paths` live paths over `avg_context_tokens` of context each, scored
        from verifier inputs of `verifier_input_tokens`, inside the start-up pools. Lengths are
        rounded up to whole blocks (so nearby loads share one memoized answer). A load whose single
        sequence exceeds a pool gets the whole pools as its caps (batches of 1, predicted inf): the
        engine's own admission decides what happens to such a sequence."""
        block_size = self.generator.block_size
        key = (max(1, num_paths), -(-max(1, avg_context_tokens) // block_size) * block_size,
               -(-max(1, verifier_input_tokens) // block_size) * block_size)
        caps = self._caps.get(key)
        if caps is None:
            load = Workload(num_sequences=key[0], verifier_input_tokens=key[2],
                            generation_tokens=self.workload.generation_tokens, avg_context_tokens=key[1])
            try:
                caps = choose_batches(self.split.generator_blocks, self.split.verifier_blocks, self.generator,
                                      tuple(self.verifiers.values()), load, self.peak_source.peaks)
            except ValueError:
                caps = BatchCaps(1, 1, self.split.generator_blocks, self._verifier_pool_tokens(),
                                 float("inf"), float("inf"))
            if len(self._caps) >= 1024:
                self._caps.clear()
            self._caps[key] = caps
        return caps

    def apply(self, caps: BatchCaps, verifier_stores) -> None:
        """Cap each verifier store's prefill tokens per step at the caps' verifier figure."""
        for store in verifier_stores:
            store.cap_prefill_tokens(caps.verifier_tokens_per_step)

    def _verifier_pool_tokens(self) -> int:
        return min(self.split.verifier_blocks) * min(v.block_size for v in self.verifiers.values())
