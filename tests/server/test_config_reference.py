"""The configuration reference (docs/configuration.md, made by server/config_reference.py) lists every
key of the settings model once, and config.example.toml, where its descriptions come from, documents
exactly the model's keys with the model's defaults."""

from __future__ import annotations

import re

from server import config_reference as ref
from server.config import Settings


def test_the_example_file_documents_every_key_of_the_model_once_and_no_other():
    described = {key: texts for key, texts in ref.example_descriptions().items() if not key.startswith("[")}
    model = ref.model_keys()
    assert sorted(described) == sorted(model)
    assert {key: len(texts) for key, texts in described.items() if len(texts) != 1} == {}
    assert "server.port" in model and "verifiers.NAME.kind" in model and "ui.max_trees" in model


def test_the_example_files_values_are_the_models_defaults():
    set_in_file = ref.example_defaults()
    model = ref.model_keys()
    assert {key: (value, model[key][1]) for key, value in set_in_file.items() if model[key][1] != value} == {}
    assert set_in_file["cache.block_size"] == "16" and set_in_file["scheduler.policy"] == '"lbs"'
    # The file as a whole is valid settings (its verifier section is commented out).
    Settings.load(ref.EXAMPLE)


def test_a_key_missing_from_the_example_or_given_twice_is_seen():
    text = ref.EXAMPLE.read_text()
    without_port = "\n".join(line for line in text.splitlines() if not line.startswith("port ="))
    assert "server.port" not in ref.example_descriptions(without_port)
    twice = text.replace("[model]\n", "[model]\ndevice = \"cpu\"  # again\n", 1)
    assert ref.example_descriptions(twice)["model.device"] == ["again", "auto | cpu | cuda"]


def test_the_reference_lists_every_key_once_with_its_environment_variable_and_default():
    text = ref.markdown()
    rows = re.findall(r"^\| `([a-z_]+)` \| .* \| `([^`]*)` \| `(PONDER_[A-Z_]+)` \|", text, flags=re.MULTILINE)
    assert len(rows) == len(ref.model_keys())
    assert len({env for _, _, env in rows}) == len(rows)
    assert ("port", "8000", "PONDER_SERVER__PORT") in rows
    assert ("kv_split", '"static"', "PONDER_CACHE__KV_SPLIT") in rows
    assert ("kind", "required", "PONDER_VERIFIERS__NAME__KIND") in rows
    assert [line for line in text.splitlines() if line.startswith("### ")] == [
        f"### `[{section}]`" for section in ref.sections()]
    # A row carries the example's description, a `|` in it escaped so the table keeps its columns.
    assert "| `device` | `\"auto\"` \\| `\"cpu\"` \\| `\"cuda\"` | `\"auto\"` | `PONDER_MODEL__DEVICE` | " \
           "auto \\| cpu \\| cuda |" in text


def test_the_environment_variable_named_is_the_one_the_settings_read(monkeypatch):
    monkeypatch.setenv(ref.Key("cache", "block_size", "int", "16", "").env, "8")
    monkeypatch.setenv(ref.Key("verifiers.NAME", "kind", "", "", "").env.replace("NAME", "PRM"), "orm")
    monkeypatch.setenv("PONDER_VERIFIERS__PRM__PATH", "/models/orm")
    settings = Settings.load()
    assert settings.cache.block_size == 8 and settings.verifiers["prm"].kind == "orm"
