"""The block GEMM's tiles for each layer shape a model launches on a GPU, timed there at start-up.

runtime/kernels/gpu/linear.py offers tiles (`TILES`: one row a program, split-K, tensor-core tiles of
sixteen rows, and both kinds over inputs quantized to int8) whose speeds differ by GPU and shape by up to
tenfold (bench/results, `linear_sweep`). A shape's tiles are chosen once, before the first step and any
CUDA graph: each tile is run at 1, 4 and 16 rows (a stream alone, a few, a search's beams), checked to
give a row the same bits alone as in the batch, and grouped by the bits it gives (tiles of one sum
order over int8 inputs give the same: `linear.sum_order`). Of the tiles that keep the bits, either one
tile for every row count, or a group's fastest at each row count (a GEMV for a stream, the tensor cores
for a search's beams, still the same bits), whichever is nearest the fastest at every count (`choose`),
becomes the shape's (`linear.CHOSEN`, keyed on the shape alone: batch invariance holds, the choice never
changes while serving). The choices are kept in the start-up cache (runtime.startup_cache,
`gpu_tiles/`), keyed on the GPU, Triton's version, the kernels' source and the shapes, so a restart
reads them.

Only the layers the Triton loop launches are timed (fused qkv and gate/up, o, down, the head); a MoE's
routed experts run their own kernels (runtime/kernels/gpu/routed.py), with the sizes of their shape's
tile at one row (`linear.tile_for`: the default tile, unless a dense layer of that shape was timed).
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

ROWS = (1, 4, 16)  # (one stream; a few; a search's sixteen beams)
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


def fits(tile: tuple[int, ...], layer: GpuBlockLinear) -> bool:
    """Whether `tile` can compute `layer`: a tensor-core tile's least sizes (16 rows, outputs and, over float
    inputs, a group's inputs), int8 inputs a group of 32 at a time."""
    block_n, block_k, _, _, block_m, ints = linear.unpack(tile)
    group = layer.in_features // layer.d.shape[1]
    if ints:
        return layer.in_features % 32 == 0 and block_k % 32 == 0 and (block_m == 1 or block_n >= 16)
    return block_m == 1 or min(block_n, group) >= 16


def rank_tiles(layer: GpuBlockLinear, dtype: torch.dtype, tiles: Iterable[tuple[int, ...]] = linear.TILES,
               rows: tuple[int, ...] = ROWS, timer: Callable[[Callable[[], object]], float] = gpu_time_ms,
               seed: int = 0) -> dict[tuple[int, ...], dict]:
    """Each tile that fits the layer and runs here: whether a row keeps its bits alone and among `max(rows)`
    (and the first three among them), its milliseconds at each of `rows`, and its `order`: the first tile
    of its sum order (`linear.sum_order`) whose rows it gave the same bits, else itself; a tile that fails
    to compile or run is left out (logged), and the default tile stays where none runs."""
    device = layer.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    batch = torch.randn(max(rows), layer.in_features, generator=gen, device=device).to(dtype)
    ranked, firsts = {}, {}  # firsts: sum order -> (its first tile, that tile's rows)
    for tile in tiles:
        if not fits(tile, layer):
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
        first, rows_bits = firsts.setdefault(linear.sum_order(tile, layer.in_features), (tile, whole))
        ms = {count: timer(lambda x=batch[:count].contiguous(): call(x)) for count in rows}
        ranked[tile] = {"kept": kept, "ms": ms, "order": first if torch.equal(whole, rows_bits) else tile}
    return ranked


Steps = tuple[tuple[int, tuple[int, ...]], ...]  # ((rows from, tile), ...): linear.CHOSEN's values


def choose(ranked: dict[tuple[int, ...], dict]) -> Steps | None:
    """Of the tiles that keep a row's bits, the steps (a tile from each row count on) whose slowest row count
    is nearest its best: each tile alone, or the tiles of one order (the same bits: int8 inputs' tiles) each
    from the row count it is fastest at. Nearest: the least worst ratio of its time to the fastest kept
    tile's at that row count (neither a stream alone nor a search's beams pays much for the other), ties to
    the least summed time; None if no tile keeps the bits."""
    kept = [tile for tile, entry in ranked.items() if entry["kept"]]
    if not kept:
        return None
    counts = sorted(ranked[kept[0]]["ms"])
    best = {rows: min(ranked[tile]["ms"][rows] for tile in kept) for rows in counts}
    candidates = {}  # steps -> ms at each row count
    for order in dict.fromkeys(ranked[tile].get("order", tile) for tile in kept):
        same = [tile for tile in kept if ranked[tile].get("order", tile) == order]
        fastest = [min(same, key=lambda tile, rows=rows: ranked[tile]["ms"][rows]) for rows in counts]
        steps = tuple((1 if i == 0 else rows, tile) for i, (rows, tile) in enumerate(zip(counts, fastest))
                      if i == 0 or tile != fastest[i - 1])
        candidates[steps] = {rows: ranked[tile]["ms"][rows] for rows, tile in zip(counts, fastest)}
        candidates.update({((1, tile),): ranked[tile]["ms"] for tile in same})
    return min(candidates, key=lambda steps: (max(candidates[steps][rows] / best[rows] for rows in counts),
                                              sum(candidates[steps].values()), len(steps)))


def describe(steps: Steps) -> str:
    """`1: 16x256x4x1x1x1, 16: 64x128x4x1x16x1`: each step's first row count and tile."""
    return ", ".join(f"{start}: {'x'.join(map(str, tile))}" for start, tile in steps)


def tune(model: nn.Module, decoder, dtype: torch.dtype, timer: Callable = gpu_time_ms,
         tiles: tuple[tuple[int, ...], ...] = linear.TILES, root: Path | None = None) -> dict[Key, Steps]:
    """Choose and set (`linear.CHOSEN`) the tiles of every block layer shape the decoder launches; read from
    the start-up cache where this GPU chose them before, else timed and written there."""
    firsts: dict[Key, GpuBlockLinear] = {}
    for layer in launched_layers(model, decoder):
        firsts.setdefault(key_of(layer), layer)  # (a shape's first layer stands for it: one choice a shape)
    if not firsts:
        return {}
    device = next(iter(firsts.values())).weight.device
    entry = Entry("gpu_tiles", {"device": _device_name(device), "triton": triton.__version__, "dtype": str(dtype),
                                "tiles": [list(t) for t in tiles], "rows": list(ROWS),
                                "shapes": sorted(list(key) for key in firsts),
                                "sources": sources_hash(runtime_sources("kernels/gpu/linear.py", "kernels/gpu/int8_linear.py",
                                                                        "kernels/gpu/block_codes.py", "model/gpu_tiles.py"))},
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
                log.info("block GEMM %dx%d: %s, %s ms at %s rows (the default tile %s)", key[0], key[1], describe(best),
                         " / ".join(f"{ms:.4f}" for ms in steps_ms(ranked, best).values()), " / ".join(map(str, ROWS)),
                         "not timed" if default is None else " / ".join(f"{ms:.4f}" for ms in default["ms"].values()))
            report["x".join(map(str, key[:2]))] = {
                "x".join(map(str, tile)): {"kept": e["kept"], "ms": e["ms"], "order": "x".join(map(str, e["order"]))}
                for tile, e in ranked.items()}
        entry.write(lambda directory: _write_choices(directory, chosen, report))
    linear.CHOSEN.update(chosen)
    log.info("block GEMM tiles on %s: %s", _device_name(device),
             "; ".join(f"{outs}x{ins} {describe(steps)}" for (outs, ins, _), steps in chosen.items()))
    return chosen


def steps_ms(ranked: dict[tuple[int, ...], dict], steps: Steps) -> dict[int, float]:
    """The milliseconds of `steps` at each row count timed: the time of the tile they take there."""
    counts = ranked[steps[0][1]]["ms"]
    return {rows: ranked[[tile for start, tile in steps if start <= rows][-1]]["ms"][rows] for rows in counts}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _write_choices(directory: Path, chosen: dict[Key, Steps], report: dict) -> None:
    text = {"chosen": [[list(key), [[start, list(tile)] for start, tile in steps]] for key, steps in chosen.items()],
            "timings": report}
    (directory / "tiles.json").write_text(json.dumps(text, indent=1))


def _read_choices(directory: Path) -> dict[Key, Steps]:
    text = json.loads((directory / "tiles.json").read_text())
    return {(int(outs), int(ins), bool(packed)): tuple((int(start), tuple(int(n) for n in tile)) for start, tile in steps)
            for (outs, ins, packed), steps in text["chosen"]}
