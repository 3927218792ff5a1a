"""The block GEMM's tile for each layer shape a model launches on a GPU, timed there at start-up.

runtime/kernels/gpu/linear.py offers tiles (`TILES`: one row a program, split-K, tensor-core tiles of
sixteen rows) whose speeds differ by GPU and shape by up to tenfold (bench/results, `linear_sweep`). A
shape's tile is chosen once, before the first step and any CUDA graph: each tile is run at one row and
at sixteen (a stream alone, a search's beams), checked to give a row the same bits alone as in the batch,
and of those that keep the bits the one nearest the fastest at both (`choose`) becomes the shape's for every
row count (`linear.CHOSEN`, keyed on the shape alone: batch invariance holds, the choice never changes
while serving). The choices are kept in the start-up cache (runtime.startup_cache, `gpu_tiles/`),
keyed on the GPU, Triton's version, the kernel's source and the shapes, so a restart reads them.

Only the layers the Triton loop launches are timed (fused qkv and gate/up, o, down, the head); a MoE's
routed experts run their own kernels (runtime/kernels/gpu/routed.py) and keep the default tile.
`model.gpu_tiles = "default"` skips this and keeps `linear.TILE` everywhere.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import triton
from torch import nn

from runtime.kernels.gpu import linear
from runtime.model.gpu_blocks import GpuBlockLinear, SideBySide
from runtime.model.projections import Projections
from runtime.startup_cache import Entry, runtime_sources, sources_hash

log = logging.getLogger(__name__)

ROWS = (1, 16)  # (one stream; a search's sixteen beams)
Key = tuple[int, int, bool]  # (outputs, inputs, packed): linear.CHOSEN's key


def launched_layers(model: nn.Module, decoder) -> list[GpuBlockLinear]:
    """The block layers the decoder's steps launch on their own: each layer's fused projections (qkv,
    gate/up, a delta layer's runs; their parts, now views of them, are not launched), o, down, the
    head; not a MoE's routed experts."""
    launched, parts = [], set()
    for layer in getattr(decoder, "layers", ()):
        for projections in _projections(layer):
            if projections.fused is not None:
                launched += _leaves(projections.fused)
                parts.update(id(part) for part in projections.layers if part is not projections.fused)
    launched += [module for name, module in model.named_modules()
                 if isinstance(module, GpuBlockLinear) and id(module) not in parts and ".experts" not in name]
    return list({id(layer): layer for layer in launched}.values())


def _projections(layer) -> list[Projections]:
    """A decoder layer's groups of projections fused into one launch (qkv, gate/up, a Qwen3.5 delta
    layer's runs of input projections)."""
    found = []
    for value in vars(layer).values():
        if isinstance(value, Projections):
            found.append(value)
        found += [run for run in getattr(value, "runs", ()) if isinstance(run, Projections)]
    return found


def _leaves(layer) -> list[GpuBlockLinear]:
    if isinstance(layer, SideBySide):
        return [leaf for part in layer.parts for leaf in _leaves(part)]
    return [layer] if isinstance(layer, GpuBlockLinear) else []


def key_of(layer: GpuBlockLinear) -> Key:
    return layer.out_features, layer.in_features, layer.packed


def _call(layer: GpuBlockLinear, tile: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    supers = None if layer.d_super is None else (layer.d_super, layer.m_super)
    return lambda x: linear.block_linear(x, layer.weight, layer.d, layer.m, layer.packed, tile=tile, supers=supers,
                                         high=layer.high, offset=layer.offset)


def gpu_time_ms(fn: Callable[[], object]) -> float:
    """The median milliseconds of `fn` on the current GPU (Triton's do_bench: CUDA events, L2 flushed)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=20, return_mode="median")


def rank_tiles(layer: GpuBlockLinear, dtype: torch.dtype, tiles: Iterable[tuple[int, ...]] = linear.TILES,
               rows: tuple[int, ...] = ROWS, timer: Callable[[Callable[[], object]], float] = gpu_time_ms,
               seed: int = 0) -> dict[tuple[int, ...], dict]:
    """Each tile that fits the layer and runs here: whether a row keeps its bits alone and among `max(rows)`
    (and the first three among them), and its milliseconds at each of `rows`; a tile that fails to
    compile or run is left out (logged), and the default tile stays where none runs."""
    device = layer.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    batch = torch.randn(max(rows), layer.in_features, generator=gen, device=device).to(dtype)
    group = layer.in_features // layer.d.shape[1]
    ranked = {}
    for tile in tiles:
        if len(tile) > 4 and tile[4] > 1 and min(tile[0], group) < 16:  # (a tensor-core tile's least sizes)
            continue
        call = _call(layer, tile)
        try:
            whole = call(batch)
        except Exception as error:  # noqa: BLE001 - a tile this GPU cannot compile (e.g. no bf16 tensor cores)
            log.warning("block GEMM tile %s does not run here for %dx%d (%s: %s); left out",
                        "x".join(map(str, tile)), layer.out_features, layer.in_features, type(error).__name__,
                        str(error)[:200])
            continue
        kept = all(torch.equal(call(batch[part].contiguous()), whole[part]) for part in (slice(5, 6), slice(0, 3))) \
            if max(rows) > 5 else True
        ms = {count: timer(lambda x=batch[:count].contiguous(): call(x)) for count in rows}
        ranked[tile] = {"kept": kept, "ms": ms}
    return ranked


def choose(ranked: dict[tuple[int, ...], dict]) -> tuple[int, ...] | None:
    """Of the tiles that keep a row's bits, the one whose slowest row count is nearest its best (the least
    worst ratio of its time to the fastest kept tile's at that row count: neither a stream alone nor a
    search's beams pays much for the other), ties to the least summed time; None if none keeps them."""
    kept = [tile for tile, entry in ranked.items() if entry["kept"]]
    if not kept:
        return None
    counts = ranked[kept[0]]["ms"]
    best = {rows: min(ranked[tile]["ms"][rows] for tile in kept) for rows in counts}
    return min(kept, key=lambda tile: (max(ranked[tile]["ms"][rows] / best[rows] for rows in counts),
                                       sum(ranked[tile]["ms"].values())))


def tune(model: nn.Module, decoder, dtype: torch.dtype, timer: Callable = gpu_time_ms,
         tiles: tuple[tuple[int, ...], ...] = linear.TILES, root: Path | None = None) -> dict[Key, tuple[int, ...]]:
    """Choose and set (`linear.CHOSEN`) the tile of every block layer shape the decoder launches; read from
    the start-up cache where this GPU chose them before, else timed and written there."""
    firsts: dict[Key, GpuBlockLinear] = {}
    for layer in launched_layers(model, decoder):
        firsts.setdefault(key_of(layer), layer)  # (a shape's first layer stands for it: one tile a shape)
    if not firsts:
        return {}
    device = next(iter(firsts.values())).weight.device
    entry = Entry("gpu_tiles", {"device": _device_name(device), "triton": triton.__version__, "dtype": str(dtype),
                                "tiles": [list(t) for t in tiles],
                                "shapes": sorted(list(key) for key in firsts),
                                "sources": sources_hash(runtime_sources("kernels/gpu/linear.py", "model/gpu_tiles.py"))},
                  root)
    chosen = entry.read(_read_choices)
    if chosen is None:
        chosen, report = {}, {}
        for key, layer in firsts.items():
            ranked = rank_tiles(layer, dtype, tiles, timer=timer)
            best = choose(ranked)
            if best is not None:
                chosen[key] = best
                default = ranked.get(tuple(linear.TILE))
                log.info("block GEMM %dx%d: tile %s, %s ms at %s rows (the default tile %s)", key[0], key[1],
                         "x".join(map(str, best)), " / ".join(f"{ms:.4f}" for ms in ranked[best]["ms"].values()),
                         " / ".join(map(str, ranked[best]["ms"])),
                         "not timed" if default is None else " / ".join(f"{ms:.4f}" for ms in default["ms"].values()))
            report["x".join(map(str, key[:2]))] = {"x".join(map(str, tile)): {"kept": e["kept"], "ms": e["ms"]}
                                                   for tile, e in ranked.items()}
        entry.write(lambda directory: _write_choices(directory, chosen, report))
    linear.CHOSEN.update(chosen)
    log.info("block GEMM tiles on %s: %s", _device_name(device),
             ", ".join(f"{outs}x{ins} {'x'.join(map(str, tile))}" for (outs, ins, _), tile in chosen.items()))
    return chosen


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _write_choices(directory: Path, chosen: dict, report: dict) -> None:
    text = {"chosen": [[list(key), list(tile)] for key, tile in chosen.items()], "timings": report}
    (directory / "tiles.json").write_text(json.dumps(text, indent=1))


def _read_choices(directory: Path) -> dict[Key, tuple[int, ...]]:
    text = json.loads((directory / "tiles.json").read_text())
    return {(int(outs), int(ins), bool(packed)): tuple(int(n) for n in tile)
            for (outs, ins, packed), tile in text["chosen"]}
