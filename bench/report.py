"""How every benchmark reports: one JSON line, a readable table, and the full JSON saved on request."""

from __future__ import annotations

import json
from pathlib import Path


def emit(results: dict, table: str, json_path: str | None, line: dict | None = None) -> None:
    """Print `line` (default: `results`) as one JSON line, then `table`; save `results` to `json_path`."""
    print(json.dumps(results if line is None else line))
    print(table)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)


def plot_path(plot_arg: str | None, json_path: str | None, default: Path) -> Path:
    """Where a benchmark's plot goes: `--plot` if given, else beside `--json`, else `default`."""
    if plot_arg:
        return Path(plot_arg)
    if json_path:
        return Path(json_path).with_suffix(".png")
    return default


def columns(header: list[str], rows: list[list], first_width: int = 15) -> list[str]:
    """A header and rows as aligned text: the first column left-aligned, the rest right-aligned,
    each as wide as its widest cell."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    widths[0] = max(widths[0], first_width)
    return [" ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in cells]


def kernel_isa() -> str:
    """The instruction set ponder's int4 kernel runs in this process ("none" where it cannot run), to
    name beside every CPU figure (`model.cpu_isa = "avx2"` keeps an AVX512 CPU on the AVX2 path)."""
    from runtime.kernels.cpu_kernels import describe_isa, q4_unavailable

    return describe_isa() if q4_unavailable() is None else "none"

