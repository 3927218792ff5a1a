"""The paper's transfer-volume model (locality-aware beam scheduling, Eq. 1-5), in bytes.

Token by token, layer-wise offload keeps as many whole layers of every path's KV in the compute
tier as fit and reloads the rest for every token:
    L_inGPU(s)  = min(N_layer, floor(Mem_GPU / KV_layer(s)))                 (1)
    DM_token(s) = (N_layer - L_inGPU(s)) * KV_layer(s)                       (2)
    DM_req      = sum over generated tokens i of DM_token(i + S_prompt)      (3)
Beam scheduling moves each path's KV once per step:
    DM_step(s)  = N_beam * KV_beam(s)                                        (4)
    DM_req      = sum over steps i of DM_step(i * N_step + S_prompt)         (5)
KV_layer(s) is one layer of every path at s tokens; KV_beam(s) every layer of one path.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_token_layer(self) -> int:
        """One token's keys and values in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_token_layer


def layers_resident(layout: KVLayout, kv_layer_bytes: int, budget_bytes: int) -> int:
    """Eq. 1: whole layers (of every path) the compute tier holds."""
    if kv_layer_bytes <= 0:
        return layout.num_layers
    return min(layout.num_layers, budget_bytes // kv_layer_bytes)


def layerwise_token_bytes(layout: KVLayout, context_tokens: int, budget_bytes: int) -> int:
    """Eq. 2: bytes reloaded to decode one token when the paths hold `context_tokens` tokens in all."""
    kv_layer = context_tokens * layout.bytes_per_token_layer
    return (layout.num_layers - layers_resident(layout, kv_layer, budget_bytes)) * kv_layer


def layerwise_request_bytes(layout: KVLayout, num_paths: int, prompt_tokens: int, generated_tokens: int,
                            budget_bytes: int) -> int:
    """Eq. 3: every path holds i + S_prompt tokens when it decodes its i-th token."""
    return sum(layerwise_token_bytes(layout, num_paths * (i + prompt_tokens), budget_bytes)
               for i in range(generated_tokens))


def beam_request_bytes(layout: KVLayout, num_paths: int, prompt_tokens: int, generated_tokens: int,
                       step_tokens: int) -> int:
    """Eq. 4-5: every path's KV moved once per step, nothing shared."""
    return sum(num_paths * (i * step_tokens + prompt_tokens) * layout.bytes_per_token
               for i in range(generated_tokens // step_tokens))
