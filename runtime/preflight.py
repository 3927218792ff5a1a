"""Check the start-up settings that only torch can judge, before anything is served.

    python -m runtime.preflight < encoded RuntimeOptions

The runtime process runs `problem` first and says what it found before it loads anything (`ponder
serve` starts that process before it binds its port, and stops there on a problem), so a setting
this machine cannot honour (`--device cuda` without CUDA, a dtype the device only emulates) stops
start-up with one line naming the setting instead of leaving a server up that answers 503. Exit status 2 and the line on stderr on a bad setting; 3 for a checkpoint that would leave a weight at
random or holds tensors nothing reads (runtime.model.loader.check_loading); 4 for an architecture ponder
cannot run exactly (runtime.model.families), the line naming what it lacks.
"""

from __future__ import annotations

import sys

from runtime.requests.admission import GRANULARITIES, check_budget
from runtime.kv.device_memory import sizes_from_device
from storage.kv_cache import kv_shape_of
from runtime.model.loader import (
    CheckpointMismatch, SettingError, check_causal_lm, pick_device, pick_dtype, resolve_model,
)
from runtime.wire.protocol import SettingsChecked
from runtime.wire.options import RuntimeOptions, decode_options
from runtime.model.quantize_setting import check_device, check_mode
from runtime.model import families, generation_config


CHECKPOINT_REFUSED = 3  # the exit status for a checkpoint that does not fill its model (2: a setting)
MODEL_REFUSED = 4  # an architecture ponder cannot run exactly


def check(options: RuntimeOptions) -> None:
    """Raise `SettingError` for the first setting this machine cannot honour."""
    device = pick_device(options.device)
    dtype = pick_dtype(options.dtype, device)
    check_mode(options.quantize)
    check_device(options.quantize, device)
    generation_config.check_mode(options.generation_config)
    if options.kv_granularity not in GRANULARITIES:
        check_budget(None, 0, 0, options.kv_granularity)
    fraction = options.gpu_memory_fraction
    if fraction is not None and not 0 < fraction <= 1:
        raise SettingError(f"cache.gpu_memory_fraction = {fraction} is not in (0, 1]")
    config = _model_config(options)
    if config is not None:
        families.check(config, resolve_model(options.model, options.served_model_name).path)
    # The roofline split, and a GPU's free memory, size the pool once every model is loaded.
    if config is not None and options.kv_split != "roofline" and not sizes_from_device(options, device):
        _check_budget(options, config, dtype)
    _check_checkpoints(options)


def _check_checkpoints(options: RuntimeOptions) -> None:
    """Raise `CheckpointMismatch` for a generator or verifier checkpoint that would leave a parameter
    at random or hold a tensor nothing reads; only the safetensors headers are read."""
    def check_verifier(spec: dict[str, str]) -> None:
        from runtime.verify.verifiers.registry import check_verifier as check

        check(spec["kind"], spec["path"], trust_remote_code=spec.get("trust_remote_code") == "true")

    checks = [lambda: check_causal_lm(resolve_model(options.model, options.served_model_name),
                                      options.trust_remote_code)]
    checks += [lambda spec=spec: check_verifier(spec) for spec in options.verifiers.values()]
    for run_check in checks:
        try:
            run_check()
        except CheckpointMismatch:
            raise
        except Exception:  # noqa: BLE001 - a model that cannot be read is reported when it loads
            continue


def _model_config(options: RuntimeOptions):
    """The generator's transformers config, or None where it cannot be read (reported when it loads)."""
    from transformers import AutoConfig

    try:
        source = resolve_model(options.model, options.served_model_name)
        if source.gguf_file:  # transformers parses the whole vocabulary for it: kept once read
            from runtime.model.cached_model import gguf_config

            return gguf_config(source, options.trust_remote_code)
        return AutoConfig.from_pretrained(source.directory, trust_remote_code=options.trust_remote_code)
    except Exception:  # noqa: BLE001 - a model that cannot be read is reported when it loads
        return None


def _check_budget(options: RuntimeOptions, config, dtype) -> None:
    """The compute budget against one path's working set, from the model's config alone."""
    shape = kv_shape_of(config, options.block_size)
    limit = getattr(config.get_text_config(), "max_position_embeddings", None) or 2048
    num_blocks = options.num_blocks or max(1, options.kv_memory_bytes // shape.bytes_per_block(dtype))
    check_budget(shape, num_blocks, min(options.max_model_len or limit, limit), options.kv_granularity)


def problem(options: RuntimeOptions) -> SettingsChecked:
    """What the runtime process says first: the settings check's verdict on `options`."""
    try:
        check(options)
    except SettingError as exc:
        return SettingsChecked(problem=str(exc), status=2)
    except CheckpointMismatch as exc:
        return SettingsChecked(problem=str(exc), status=CHECKPOINT_REFUSED)
    except families.UnsupportedModel as exc:
        return SettingsChecked(problem=str(exc), status=MODEL_REFUSED)
    except Exception as exc:  # noqa: BLE001 - a check that fails says why, rather than end the process unheard
        return SettingsChecked(problem=f"the settings check failed: {type(exc).__name__}: {' '.join(str(exc).split())}",
                               status=1)
    return SettingsChecked()


def main() -> int:
    verdict = problem(decode_options(sys.stdin.buffer.read()))
    if verdict.problem is not None:
        print(verdict.problem, file=sys.stderr)
    return verdict.status


if __name__ == "__main__":
    sys.exit(main())
