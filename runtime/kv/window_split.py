"""Sliding-window layers' KV kept apart, so a block that left every sliding layer's window is released.

A block of the one KV tensor holds every layer's keys and values, so a model whose layers mostly slide
(Gemma 3: 5 of 6, window 512; Mistral: all) would keep a long prompt's every block for the sake of its
few full-attention layers. Here the layers are two groups, each with its own tensor and block pool of
the same block size: the full-attention layers' (`KVCache`, `BlockPool`, a sequence's `block_table`, as
before) and the sliding layers' (a sequence's `window_table`, whose blocks before the window of its
next token go back to their pool: scheduler.sliding_window). Either group may be empty of layers: an
all-sliding model's first pool holds no memory and only keeps the sequences' block names.

The KV budget (`num_blocks` blocks of every layer) is split by need: the sliding pool gets what
`max_num_seqs` sequences' windows and one step's new tokens can hold at once (no more than the budget),
the full layers' pool the rest, so it never holds fewer blocks than the budget's.

Kept in one tensor (today's layout, said at start-up) where a path reads one cache for every layer:
host and disk tiers and head-wise offload move whole blocks, the stack kernel (runtime.model.layer_stack)
takes one cache tensor, and linear-attention layers keep states per block. (A GPU's Triton layer loop and
its CUDA graphs read each sliding layer from its own cache.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from runtime.model.decoder import LeanDecoder, layer_window
from runtime.model.model_runner import SlidingCache
from scheduler.sliding_window import SlidingWindow
from storage.block_pool import BlockPool
from storage.kv_cache import KVCache, KVShape

log = logging.getLogger("ponder.runtime")


@dataclass(frozen=True)
class WindowSplit:
    """Which layers slide (`places[layer]` = (slides, index in its group's cache)) and the pools' sizes."""

    window: int  # the widest window of the sliding layers
    places: tuple[tuple[bool, int], ...]
    num_full_blocks: int
    num_window_blocks: int

    @property
    def num_sliding(self) -> int:
        return sum(sliding for sliding, _ in self.places)


def layer_windows(model) -> list[int | None] | None:
    """Each layer's sliding window (None: full attention), as the lean decoder and transformers' modules
    apply it; None where a layer has no attention of that kind (a linear-attention layer)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = getattr(getattr(model, "base_model", None), "layers", None)
    if layers is None:
        return None
    attentions = [getattr(layer, "self_attn", None) for layer in layers[:config.num_hidden_layers]]
    if any(attn is None for attn in attentions):
        return None
    return [layer_window(config, attn) for attn in attentions]


def pool_sizes(num_blocks: int, num_layers: int, num_sliding: int, window: int, block_size: int, max_num_seqs: int,
               max_num_batched_tokens: int, max_model_len: int) -> tuple[int, int]:
    """(full layers' blocks, sliding layers' blocks) for a budget of `num_blocks` blocks of every layer. A
    sequence holds at most ceil((n + window - 1) / block_size) + 1 sliding blocks in a step of n tokens."""
    per_sequence = -(-(window - 1) // block_size) + 2
    need = max_num_seqs * per_sequence + -(-max_num_batched_tokens // block_size)
    if num_sliding == num_layers:  # the first pool holds no memory: enough names for every sequence's blocks
        return max(num_blocks, max_num_seqs * -(-max_model_len // block_size)), num_blocks
    window_blocks = min(num_blocks, need)
    return (num_blocks * num_layers - window_blocks * num_sliding) // (num_layers - num_sliding), window_blocks


def split_pools(model, config, shape: KVShape, dtype, device: torch.device, num_blocks: int, has_tiers: bool,
                recurrent: bool) -> tuple[KVShape, int, SlidingWindow | None, SlidingCache | None]:
    """(the shape and count of the compute pool's blocks, the sliding layers' pool and cache, or None and
    None where every layer stays in the one cache) for this model and engine config (EngineConfig)."""
    split = plan_split(model, config, num_blocks, has_tiers, recurrent)
    if split is None:
        return shape, num_blocks, None, None
    full_shape, window, sliding = split_caches(split, shape, dtype, device)
    return full_shape, split.num_full_blocks, window, sliding


def plan_split(model, config, num_blocks: int, has_tiers: bool, recurrent: bool) -> WindowSplit | None:
    """The split for this model and engine config (runtime.engine.EngineConfig), or None: one tensor for
    every layer, where no layer slides or a path needs it so (said at start-up)."""
    windows = layer_windows(model)
    if not windows or not any(windows):
        return None
    decoder = LeanDecoder.build(model)
    reasons = [reason for reason, holds in (
        ("linear-attention layers keep their states by block", recurrent),
        ("a host or disk tier moves whole blocks", has_tiers),
        ("head-wise offload streams whole blocks", config.kv_granularity != "block"),
        ("the stack kernel reads one cache", decoder is not None and decoder.stack is not None))
        if holds]
    if reasons:
        log.info("sliding-window KV: kept in one cache with the other layers' (%s)", "; ".join(reasons))
        return None
    window = max(w for w in windows if w)
    counts = [0, 0]
    places = []
    for w in windows:
        places.append((bool(w), counts[bool(w)]))
        counts[bool(w)] += 1
    full, sliding = pool_sizes(num_blocks, len(windows), counts[1], window, config.block_size, config.max_num_seqs,
                               config.max_num_batched_tokens, config.max_model_len)
    log.info("sliding-window KV: %d of %d layers slide (window %d): their blocks, %d in a pool of their own, are "
             "released as they leave the window; the other layers' pool: %d blocks", counts[1], len(windows), window,
             sliding, full)
    return WindowSplit(window, tuple(places), full, sliding)


def split_caches(split: WindowSplit, shape: KVShape, dtype, device) -> tuple[KVShape, SlidingWindow, SlidingCache]:
    """(the full layers' KV shape, the sliding layers' pool, their cache): the runner's and manager's parts."""
    sliding = KVCache(replace(shape, num_layers=split.num_sliding), split.num_window_blocks, dtype, device, scratch=True)
    pool = SlidingWindow(BlockPool(split.num_window_blocks, shape.block_size), split.window)
    return replace(shape, num_layers=shape.num_layers - split.num_sliding), pool, \
        SlidingCache(sliding, split.places, split.window)
