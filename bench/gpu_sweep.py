"""Each matmul of a decode step on its own, for the device check (bench/gpu.py): torch's linear against
the Triton GEMM over float weights and over 4-bit blocks, at every tile the kernel offers."""

from __future__ import annotations

import time

import torch

from bench.gpu_models import empty_cache


def layer_shapes(shapes: dict) -> dict[str, tuple[int, int]]:
    """The lean decoder's matmuls of a llama of `shapes`: (outputs, inputs) by name."""
    hidden, heads, kv_heads = shapes["hidden_size"], shapes["num_attention_heads"], shapes["num_key_value_heads"]
    dim = hidden // heads
    return {"qkv": ((heads + 2 * kv_heads) * dim, hidden), "o": (hidden, hidden),
            "gate_up": (2 * shapes["intermediate_size"], hidden), "down": (hidden, shapes["intermediate_size"]),
            "head": (shapes["vocab_size"], hidden)}


def _timed_ms(fn, device: torch.device, repeats: int = 20) -> float:
    """The median milliseconds of `fn` on `device` (triton's do_bench on a GPU: flushed L2, CUDA events)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=repeats, return_mode="median")
    times = []
    for _ in range(3):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[1]


def linear_sweep(report: dict, device: torch.device, shapes: dict, dtype: torch.dtype,
                 rows_set: tuple[int, ...] = (1, 4, 16), tiles=None) -> None:
    """Each matmul of a model of `shapes` on its own, as bandwidth (bytes read / time): torch's linear,
    and the Triton GEMM over the same float weights (int8 inputs' tiles: blocks only) and over packed
    4-bit blocks at every tile of `tiles`, each checked to give a row the same bits alone as in a batch of
    16. Of the tiles that keep the bits, the steps nearest the fastest at every row count timed (one tile,
    or int8 inputs' tiles of one sum order each from the row count it is fastest at; one stream and a
    search's sixteen beams weigh alike, as at start-up: runtime.model.gpu_tiles.choose) become the shape's
    block tiles for the rest of the run (runtime.kernels.gpu.linear.CHOSEN, keyed on the shape alone, so
    a row's bits still never depend on the rows); a later layer of the same shape keeps them
    (`chosen_by` names the layer that chose them), so no two timings of one shape can disagree."""
    import torch.nn.functional as F

    from runtime.kernels.gpu import linear as triton_linear
    from runtime.model.gpu_tiles import choose, describe

    tiles = tiles or triton_linear.TILES
    table = report.setdefault("linear_sweep", {})
    chosen_here: dict[tuple[int, int], str] = {}  # (out, in) -> the layer whose timings chose its tile
    for name, (outs, ins) in layer_shapes(shapes).items():
        entry = table.setdefault(name, {"shape": [outs, ins]})
        weight = torch.randn(outs, ins, device=device, dtype=dtype) * 0.02
        codes = torch.randint(0, 256, (outs, ins // 2), dtype=torch.uint8, device=device)
        d = torch.randint(1, 64, (outs, ins // 32), dtype=torch.int8, device=device)  # Q4_K's scales, as held
        m = -(d // 2)
        count = max(1, ins // 256)  # (a tiny dry-run model's narrower layers: one a row)
        supers = (torch.rand(outs, count, device=device) * 0.00005, torch.rand(outs, count, device=device) * 0.0004)
        block_bytes = codes.numel() + 2 * d.numel() + 2 * supers[0].numel() * 4
        batch = torch.randn(max(rows_set), ins, device=device, dtype=dtype)
        ranked: dict[tuple, dict] = {}  # tile -> its block GEMM's kept bits, ms by rows, order (runtime.model.gpu_tiles')
        firsts: dict[tuple, tuple] = {}  # a sum order's first tile and its rows' outputs
        for tile in tiles:
            key = "x".join(map(str, tile))
            q4 = lambda rows: triton_linear.block_linear(rows, codes, d, m, packed=True, tile=tile,  # noqa: E731
                                                         supers=supers)
            fl = lambda rows: triton_linear._launch(rows, weight, None, None, tile=tile)  # noqa: E731
            ints = triton_linear.unpack(tile)[5]  # (int8 inputs: blocks only)
            whole = q4(batch)
            first, bits = firsts.setdefault(triton_linear.sum_order(tile, ins), (tile, whole))
            ranked[tile] = {"ms": {}, "order": first if torch.equal(whole, bits) else tile,
                            "kept": all(torch.equal(fn(batch[5:6]), fn(batch)[5:6]) and
                                        torch.equal(fn(batch[:3]), fn(batch)[:3]) for fn in ((q4,) if ints else (q4, fl)))}
            for rows in rows_set:
                x = batch[:rows].contiguous()
                ms = _timed_ms(lambda: q4(x), device)
                entry.setdefault(f"q4_rows_{rows}", {})[key] = {"ms": round(ms, 4), "gbs": round(block_bytes / ms / 1e6, 1)}
                ranked[tile]["ms"][rows] = ms
                if not ints:
                    ms = _timed_ms(lambda: fl(x), device)
                    entry.setdefault(f"triton_float_rows_{rows}", {})[key] = {"ms": round(ms, 4),
                                                                              "gbs": round(weight.nbytes / ms / 1e6, 1)}
            whole = None
        for rows in rows_set:
            x = batch[:rows].contiguous()
            ms = _timed_ms(lambda: F.linear(x, weight), device)
            entry[f"torch_rows_{rows}"] = {"ms": round(ms, 4), "gbs": round(weight.nbytes / ms / 1e6, 1)}
        entry["rows_keep_their_bits"] = {"x".join(map(str, tile)): e["kept"] for tile, e in ranked.items()}
        best = choose(ranked)
        if (outs, ins) in chosen_here:  # a shape has one tile: the first layer of that shape chose it
            entry["chosen_tile"] = describe(triton_linear.CHOSEN[(outs, ins, True)])
            entry["chosen_by"] = chosen_here[(outs, ins)]
        elif best is not None:
            triton_linear.CHOSEN[(outs, ins, True)] = best
            chosen_here[(outs, ins)] = name
            entry["chosen_tile"] = describe(best)
        else:
            report["errors"].append(f"linear_sweep {name}: no tile keeps a row's bits in a batch")
        weight = codes = d = m = supers = None  # (the shape's tensors freed before the next one's)
    empty_cache()
