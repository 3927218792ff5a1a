import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from server.config import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_example_config_loads_and_equals_the_defaults():
    assert Settings.load(ROOT / "config.example.toml").model_dump() == Settings.load().model_dump()


def test_example_config_documents_every_key():
    """Each key of each section appears in config.example.toml, set or commented out, under its section."""
    import re

    from server.config import Settings as S

    text = (ROOT / "config.example.toml").read_text()
    sections = {m.group(1): m.start() for m in re.finditer(r"^\[(\w+)\]", text, re.MULTILINE)}
    for section, field in S.model_fields.items():
        if section == "verifiers":
            assert "[verifiers." in text
            continue
        start = sections[section]
        following = [pos for pos in sections.values() if pos > start]
        body = text[start:min(following, default=len(text))]
        for key in field.annotation.model_fields:
            assert re.search(rf"^#? ?{key} = ", body, re.MULTILINE), f"[{section}] {key} is not documented"


def test_precedence_cli_over_env_over_file(tmp_path, monkeypatch):
    config = tmp_path / "c.toml"
    config.write_text('[server]\nport = 7000\nhost = "0.0.0.0"\n[cache]\nblock_size = 32\n')
    monkeypatch.setenv("PONDER_SERVER__PORT", "7100")
    monkeypatch.setenv("PONDER_CACHE__NUM_BLOCKS", "99")
    settings = Settings.load(config, server={"port": 7200, "host": None})
    assert settings.server.port == 7200  # CLI
    assert settings.server.host == "0.0.0.0"  # file (the CLI gave none)
    assert settings.cache.num_blocks == 99 and settings.cache.block_size == 32
    options = settings.runtime_options()
    assert options.num_blocks == 99 and options.block_size == 32


def test_settings_are_frozen_and_strict(tmp_path):
    settings = Settings.load()
    with pytest.raises(ValidationError):
        settings.server.port = 1  # type: ignore[misc]
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nprot = 1\n")
    with pytest.raises(ValidationError):
        Settings.load(bad)


def test_the_http_process_does_not_import_torch():
    code = "import sys, server.app, server.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cli_help_lists_the_documented_flags():
    out = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--help"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    for flag in ["--model", "--config", "--host", "--port", "--device", "--dtype", "--quantize", "--max-model-len",
                 "--api-key"]:
        assert flag in out


def test_every_bench_name_the_cli_offers_is_a_benchmark_with_a_main():
    import importlib

    from server.cli import build_parser

    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    names = next(action.choices for action in bench._actions if action.dest == "name")
    assert "serving-load" in names and "timeout" in names
    for name in names:
        assert callable(importlib.import_module(f"bench.{name.replace('-', '_')}").main), name


def test_a_bad_setting_stops_start_up_with_one_line_naming_it(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nquantize = "int3"\n')
    out = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--config", str(bad)], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr == ("ponder: invalid settings: model.quantize: Input should be 'auto', 'none', 'int8' or 'int4'\n")


def test_batch_invariance_is_auto_by_default_and_the_flags_insist_or_opt_out(tmp_path, monkeypatch):
    from server.cli import build_parser, settings_from_args

    monkeypatch.delenv("PONDER_SCHEDULER__BATCH_INVARIANT", raising=False)
    default = settings_from_args(build_parser().parse_args(["serve"]))
    assert default.scheduler.batch_invariant == "auto" and default.runtime_options().batch_invariant == "auto"
    fast = settings_from_args(build_parser().parse_args(["serve", "--no-deterministic"]))
    assert fast.scheduler.batch_invariant is False and fast.runtime_options().batch_invariant is False
    exact = settings_from_args(build_parser().parse_args(["serve", "--deterministic"]))
    assert exact.scheduler.batch_invariant is True and exact.runtime_options().batch_invariant is True
    config = tmp_path / "c.toml"
    config.write_text("[scheduler]\nbatch_invariant = true\n")
    assert settings_from_args(build_parser().parse_args(["serve", "--config", str(config)])).scheduler.batch_invariant


def test_the_models_sampling_defaults_apply_unless_turned_off(tmp_path, monkeypatch):
    from server.cli import build_parser, settings_from_args

    monkeypatch.delenv("PONDER_MODEL__GENERATION_CONFIG", raising=False)
    default = settings_from_args(build_parser().parse_args(["serve"]))
    assert default.model.generation_config == "auto" and default.runtime_options().generation_config == "auto"
    off = settings_from_args(build_parser().parse_args(["serve", "--generation-config", "none"]))
    assert off.runtime_options().generation_config == "none"
    config = tmp_path / "c.toml"
    config.write_text('[model]\ngeneration_config = "none"\n')
    assert settings_from_args(build_parser().parse_args(["serve", "--config", str(config)])).model.generation_config \
        == "none"


@pytest.mark.parametrize("section, line, message", [
    ("scheduler", 'policy = "fastest"', "scheduler.policy: Input should be 'lbs', 'lbs_no_prefix' or 'token'"),
    ("scheduler", 'kv_granularity = "layer"', "scheduler.kv_granularity: Input should be 'block' or 'head'"),
    ("model", 'generation_config = "vllm"', "model.generation_config: Input should be 'auto' or 'none'"),
])
def test_an_unknown_policy_or_granularity_stops_start_up(tmp_path, section, line, message):
    bad = tmp_path / "bad.toml"
    bad.write_text(f"[{section}]\n{line}\n")
    out = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--config", str(bad)], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr == f"ponder: invalid settings: {message}\n"


def test_log_level_is_a_logging_level_in_any_case(monkeypatch):
    monkeypatch.setenv("PONDER_SERVER__LOG_LEVEL", "warning")
    assert Settings.load().server.log_level == "WARNING"
    monkeypatch.setenv("PONDER_SERVER__LOG_LEVEL", "verbose")
    with pytest.raises(ValidationError, match="log_level 'verbose' is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL"):
        Settings.load()


def test_the_runtime_process_logs_at_the_level_it_is_given():
    # `ponder serve` hands the server's level to the runtime process as PONDER_LOG_LEVEL, in any case (the
    # process stops at its socket here, given none, after setting up its logging)
    code = ("import logging, runtime.process as p\n"
            "try:\n    p.main(['--fd', '-1'])\nexcept ValueError:  # negative file descriptor\n    pass\n"
            "print(logging.getLogger().level)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PONDER_LOG_LEVEL": "debug"},
                         capture_output=True, text=True, cwd=ROOT, timeout=600)  # (the imports, on a busy machine)
    assert out.stdout.strip().splitlines()[-1] == str(logging.DEBUG), out.stderr[-2000:]
