"""Where an accuracy run's problems and engine come from: the generated set or the user's dataset, and
the engine's options, from the model alone or a `ponder serve` settings file (bench.accuracy)."""

from __future__ import annotations

from bench.accuracy_configs import VERIFIERS
from bench.datasets import load_problems
from bench.problems import LEVELS, Problem, problem_set, select_levels


def int_list(text: str, what: str = "N") -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma-separated list of integers, got {text!r}") from None


def runtime_options(model: str | None, config: str | None, deterministic: bool = False):
    """The engine's options and the verifier names a run may use. Without `config`: the model on the CPU,
    as the other benchmarks run; with it: what `ponder serve --config` would load, reward models too.
    `deterministic` insists on batch invariance, as `ponder serve --deterministic` does (without it,
    the default: invariant wherever the device can be)."""
    from runtime.wire.options import RuntimeOptions

    if config is None:
        return RuntimeOptions(model=model, device="cpu", batch_invariant=True if deterministic else "auto"), VERIFIERS
    from pydantic import ValidationError

    from server.config import Settings

    try:
        settings = Settings.load(config, model={"path": model},
                                 scheduler={"batch_invariant": deterministic or None})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(f"{config}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    except (OSError, ValueError) as exc:  # a missing file, TOML that does not parse
        raise ValueError(f"{config}: {exc}") from None
    return settings.runtime_options(), VERIFIERS + tuple(settings.verifiers)


def choose_problems(dataset: str | None, levels: str | None, limit: int | None, seed: int,
                    per_level: int) -> list[Problem]:
    """The user's file, or the generated set; only `levels` of it, and its first `limit` problems."""
    chosen_levels = tuple(int_list(levels, "--levels")) if levels else None
    if dataset is not None:
        problems = load_problems(dataset)
        if chosen_levels:
            problems = select_levels(problems, chosen_levels)
    else:
        problems = problem_set(seed, per_level, chosen_levels or LEVELS)
    if limit is not None:
        if limit < 1:
            raise ValueError(f"--limit must be at least 1, got {limit}")
        problems = problems[:limit]
    return problems
