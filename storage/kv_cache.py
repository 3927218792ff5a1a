"""The compute-tier KV tensor.

Layout `[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]`: one block (all layers,
keys and values) is one contiguous unit, so a block moves between tiers as a single copy, and the
(layer, KV-head group) slice of a block is `kv[block, layer, :, h0:h1]` for head-wise transfers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        elements = 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim
        return elements * torch.empty((), dtype=dtype).element_size()


class KVCache:
    def __init__(self, shape: KVShape, num_blocks: int, dtype: torch.dtype, device: torch.device,
                 scratch: bool = False) -> None:
        """`scratch`: one more block, id `num_blocks`, outside the pool, where writes nobody reads go."""
        self.shape = shape
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = device
        self.kv = torch.zeros((num_blocks + int(scratch), *shape.block_shape), dtype=dtype, device=device)
        self.scratch_block = num_blocks if scratch else None

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def bytes_per_block(self) -> int:
        return self.shape.bytes_per_block(self.dtype)

    @property
    def layer_rows(self) -> int:
        """How far apart, in `rows()`, one layer's rows are from the next one's."""
        return 2 * self.shape.num_kv_heads * self.shape.block_size

    def rows(self) -> torch.Tensor:
        """The cache as `[blocks * layers * 2 * heads * block_size, head_dim]`: the row of (block, layer,
        key 0 / value 1, head, offset) is `row_index(block, offset) + layer * layer_rows + kv * heads *
        block_size + head * block_size` (a view: writes to it are writes to the cache)."""
        return self.kv.view(-1, self.shape.head_dim)

    def row_index(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """`[2, *blocks.shape, heads]` rows of layer 0's keys (0) and values (1) at (block, offset)."""
        s = self.shape
        base = blocks * (s.num_layers * self.layer_rows) + offsets
        heads = torch.arange(s.num_kv_heads, device=base.device) * s.block_size
        kv = torch.arange(2, device=base.device) * (s.num_kv_heads * s.block_size)
        ones = (1,) * base.dim()
        return kv.view(2, *ones, 1) + base.view(1, *base.shape, 1) + heads.view(1, *ones, -1)

    def write_rows(self, layer: int, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store one layer's keys/values `[num_tokens, num_kv_heads, head_dim]` at `rows` `[2, num_tokens,
        heads]` (`row_index` of their slots)."""
        self.rows().index_copy_(0, (rows + layer * self.layer_rows).view(-1),
                                torch.stack((key, value)).view(-1, self.shape.head_dim))

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `block_table` `[num_seqs, max_blocks]` as `[num_seqs, heads, tokens, dim]`."""
        blocks = self.kv[block_table, layer]  # [S, B, 2, H, bs, D]
        s, b, _, h, bs, d = blocks.shape
        key = blocks[:, :, 0].permute(0, 2, 1, 3, 4).reshape(s, h, b * bs, d)
        value = blocks[:, :, 1].permute(0, 2, 1, 3, 4).reshape(s, h, b * bs, d)
        return key, value

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst (copy-on-write of a shared, partially filled block)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        self.kv[dst] = self.kv[src]

    def read_block(self, block_id: int) -> torch.Tensor:
        """A view of one block's payload `[layers, 2, heads, block_size, dim]` (no copy)."""
        return self.kv[block_id]

    def staging_block(self) -> torch.Tensor:
        """A fresh host buffer for one block's payload, pinned when the cache is on a GPU."""
        return torch.empty(self.shape.block_shape, dtype=self.dtype, pin_memory=self.device.type == "cuda")

    def write_block(self, block_id: int, payload: torch.Tensor, *, is_private: bool = False) -> None:
        """Copy one block's payload in; the caller may reuse `payload`'s memory as soon as this returns.

        From host memory into a GPU cache the copy is asynchronous, queued on the current stream
        ahead of the work that reads the block. It reads from pinned memory nobody else holds: a
        `staging_block()` the caller filled and hands over (`is_private`), or a private copy made
        here. Pinned memory freed while a copy from it is queued is not reused before the copy ends
        (torch's host allocator records the stream), so no event is needed on this side.
        """
        target = self.kv[block_id]
        if not (target.is_cuda and payload.device.type == "cpu"):
            target.copy_(payload)
            return
        if not (is_private and payload.is_pinned()):
            payload = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True).copy_(payload)
        target.copy_(payload, non_blocking=True)


def attention_sizes(text_config) -> tuple[int, int]:
    """(KV heads, head size) of a transformers text config's attention: the largest of any layer where
    they differ by layer (Gemma 4's global layers: a heterogeneous config's `per_layer_config`, whose
    global values cannot be read). A narrower layer's keys are padded to them in the cache
    (runtime.model.attention)."""
    num_heads = text_config.num_attention_heads
    layers = getattr(text_config, "per_layer_config", None)
    layers = list(layers) if layers else [text_config]
    head_dim = max(getattr(layer, "head_dim", None) or text_config.hidden_size // num_heads for layer in layers)
    num_kv_heads = max(getattr(layer, "num_key_value_heads", None) or num_heads for layer in layers)
    return num_kv_heads, head_dim


def kv_shape_of(model_config, block_size: int) -> KVShape:
    """The KV shape of a transformers model config (its text config for a multimodal one)."""
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    num_kv_heads, head_dim = attention_sizes(text_config)
    return KVShape(text_config.num_hidden_layers, num_kv_heads, head_dim, block_size)
