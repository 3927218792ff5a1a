"""The generator's KV pool on a GPU: what a fraction of the device's memory leaves once the models are loaded.

On a CPU the pool is `kv_memory_bytes` (2 GiB unless set). On a GPU a fixed 2 GiB would leave most
of a 24 GB card idle, so when neither `kv_memory_bytes` nor `num_blocks` was set (`gpu_memory_fraction`
is then given, see server.config), the pool is sized after the models load, as vLLM's
`gpu_memory_utilization` does: of `fraction` x the device's total memory, what is not already in use
(the weights, the CUDA context, any other process) nor held back for one step's activations and the
reward models' own KV pools.

The activation reserve is an estimate from the model's shapes, not a profiled forward: it has never
been checked against a GPU's peak (no GPU was at hand), hence the factor of two.
"""

from __future__ import annotations

from storage.kv_cache import attention_sizes


FLOAT32_BYTES = 4


def kv_pool_blocks(free: int, total: int, fraction: float, reserve: int, bytes_per_block: int) -> int:
    """Blocks of `bytes_per_block` the KV pool may take: `fraction` of the device's `total` bytes, less
    what is in use now (`total - free`), less `reserve`; 0 when that leaves less than one block."""
    budget = int(total * fraction) - (total - free) - reserve
    return max(0, budget // bytes_per_block)


def activation_reserve(text_config, num_tokens: int, num_logit_rows: int, max_model_len: int,
                       dtype_bytes: int) -> int:
    """Bytes one step's activations may take at most, for a step of `num_tokens` tokens whose head
    computes `num_logit_rows` rows, doubled for the allocator's rounding and the temporaries between
    operators. Counted: one layer's live tensors in the lean forward (runtime.model.decoder: the residual,
    the normed input, q/k/v and the rotated q/k, the attention output, gate/up, the activation and
    its product, the down projection); one decode attention group (`GATHER_TOKENS` keys and values
    gathered, keys in float32, scores and weights in float32); a prefill chunk's cached keys and
    values gathered over `max_model_len` tokens; the logits with their float32 copies for sampling."""
    from runtime.model.row_padding import GATHER_TOKENS  # the model side: start-up's settings check imports this module

    hidden = text_config.hidden_size
    heads = text_config.num_attention_heads
    kv_heads, head_dim = attention_sizes(text_config)
    intermediate = getattr(text_config, "intermediate_size", None) or 4 * hidden
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    per_token = 5 * hidden + (q_width + 2 * kv_width) + 2 * (q_width + kv_width) + q_width + 4 * intermediate
    layer = num_tokens * per_token * dtype_bytes
    attention = GATHER_TOKENS * (2 * kv_width * dtype_bytes + kv_width * FLOAT32_BYTES + 2 * heads * FLOAT32_BYTES)
    prefill = 2 * max_model_len * kv_width * dtype_bytes
    logits = num_logit_rows * text_config.vocab_size * (dtype_bytes + 3 * FLOAT32_BYTES)
    return 2 * (layer + attention + prefill + logits)


def sizes_from_device(options, device) -> bool:
    """Whether the generator's KV pool is sized from the device's memory (runtime.wire.options.RuntimeOptions:
    a `gpu_memory_fraction`, no `num_blocks`, on CUDA) rather than from `kv_memory_bytes`."""
    return device.type == "cuda" and options.num_blocks is None and options.gpu_memory_fraction is not None
