"""The model author's sampling defaults: the sampling fields of a checkpoint's `generation_config.json`
that ponder supports, applied by the server where a request leaves them unset (as vLLM's default
`--generation-config auto`).

A field counts only where it differs from transformers' own default for it: a file that repeats a library
default (`top_k: 50`, `temperature: 1.0`) says nothing of the author's and changes nothing here, as
vLLM's `to_diff_dict()` makes it. `do_sample` is not read (nor is it by vLLM): it is `generate()`'s switch
between greedy and sampled decoding, while an OpenAI request samples unless its temperature is 0; the
values the author wrote still say how to sample. A GGUF file carries no generation config: nothing applies.
"""

from __future__ import annotations

import logging
from pathlib import Path

from runtime.model.loader import ModelSource, SettingError

log = logging.getLogger("ponder.runtime")

MODES = ("auto", "none")  # model.generation_config
FILE = "generation_config.json"

# The fields read, with transformers' defaults for them (GenerationConfig's defaults before 5.0,
# `GenerationConfig._get_default_generation_params()` since): a value equal to its default is not the author's.
LIBRARY_DEFAULTS: dict[str, float | int | None] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0,
}

# What ponder's sampler accepts of each (the request's own bounds, server.schemas): other values are
# left out, with a warning, rather than failing every request that relies on them.
_VALID = {
    "temperature": lambda v: 0.0 <= v <= 2.0,
    "top_p": lambda v: 0.0 < v <= 1.0,
    "top_k": lambda v: v >= 0 and float(v).is_integer(),
    "min_p": lambda v: 0.0 <= v <= 1.0,
    "repetition_penalty": lambda v: 0.0 < v <= 10.0,
}


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise SettingError(f"model.generation_config = {mode!r} is not one of {', '.join(MODES)}")


def sampling_defaults(source: ModelSource, mode: str = "auto") -> dict[str, float | int]:
    """The author's sampling defaults under `mode` (auto: read; none: none), said in one log line."""
    check_mode(mode)
    defaults, why = _read(source, mode)
    if defaults:
        shown = ", ".join(f"{name}={value}" for name, value in defaults.items())
        log.info("default sampling parameters from the model's %s: %s (where a request leaves them unset; "
                 "model.generation_config = none keeps ponder's own)", FILE, shown)
    else:
        log.info("default sampling parameters: ponder's own (%s)", why)
    return defaults


def _read(source: ModelSource, mode: str) -> tuple[dict[str, float | int], str]:
    if mode == "none":
        return {}, "model.generation_config = none"
    if source.gguf_file:
        return {}, f"a GGUF file carries no {FILE}"
    if not (Path(source.directory) / FILE).is_file():
        return {}, f"the model has no {FILE}"
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(source.directory)
    except Exception as exc:  # noqa: BLE001 - a broken file costs the defaults, not the model
        log.warning("the model's %s cannot be read, so none of its sampling defaults apply: %s", FILE, exc)
        return {}, f"its {FILE} cannot be read"
    return author_values(config.to_diff_dict()), f"its {FILE} sets no sampling field ponder reads"


def author_values(fields: dict) -> dict[str, float | int]:
    """The sampling fields of a generation config's `to_diff_dict()` that differ from transformers'
    defaults and that ponder's sampler accepts, in LIBRARY_DEFAULTS' order."""
    values: dict[str, float | int] = {}
    for name, default in LIBRARY_DEFAULTS.items():
        value = fields.get(name)
        if value is None or value == default or isinstance(value, bool):
            continue
        if not isinstance(value, (int, float)) or not _VALID[name](value):
            log.warning("the model's %s sets %s = %r, which ponder does not accept: left out", FILE, name, value)
            continue
        values[name] = int(value) if name == "top_k" else float(value)
    return values
