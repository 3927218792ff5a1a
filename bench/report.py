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
