"""The model author's sampling defaults (runtime.model.generation_config): what a checkpoint's
generation_config.json gives, and when nothing does."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from runtime.model.generation_config import author_values, sampling_defaults
from runtime.model.loader import ModelSource, SettingError

# Qwen/Qwen2.5-7B-Instruct's generation_config.json as published.
QWEN25_INSTRUCT = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True,
                   "eos_token_id": [151645, 151643], "repetition_penalty": 1.05, "temperature": 0.7,
                   "top_p": 0.8, "top_k": 20, "transformers_version": "4.37.0"}
QWEN25_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def folder(tmp_path: Path, generation_config: dict | None) -> ModelSource:
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return ModelSource(tmp_path.name, str(tmp_path))


def test_the_authors_sampling_fields_are_read(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="ponder.runtime"):
        defaults = sampling_defaults(folder(tmp_path, QWEN25_INSTRUCT))
    assert defaults == QWEN25_DEFAULTS
    assert [type(defaults[k]) for k in ("temperature", "top_k")] == [float, int]
    lines = [r.getMessage() for r in caplog.records if "default sampling parameters" in r.getMessage()]
    assert lines == ["default sampling parameters from the model's generation_config.json: temperature=0.7, "
                     "top_p=0.8, top_k=20, repetition_penalty=1.05 (where a request leaves them unset; "
                     "model.generation_config = none keeps ponder's own)"]


def test_values_that_repeat_transformers_defaults_are_not_the_authors(tmp_path):
    repeats = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0, "do_sample": True}
    assert sampling_defaults(folder(tmp_path, repeats)) == {}
    assert author_values({**repeats, "min_p": 0.05, "top_k": 40}) == {"top_k": 40, "min_p": 0.05}


def test_do_sample_false_is_not_read_as_greedy():
    # As vLLM: do_sample is generate()'s switch; the sampling values still say how to sample.
    assert author_values({"do_sample": False, "temperature": 0.6, "top_p": 0.9}) == {"temperature": 0.6, "top_p": 0.9}


def test_values_ponder_does_not_accept_are_left_out(caplog):
    with caplog.at_level(logging.WARNING, logger="ponder.runtime"):
        values = author_values({"temperature": -1.0, "top_p": 0.0, "top_k": 2.5, "min_p": 0.1,
                                "repetition_penalty": "high"})
    assert values == {"min_p": 0.1}
    assert len([r for r in caplog.records if "which ponder does not accept" in r.getMessage()]) == 4


@pytest.mark.parametrize("config", [None, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}])
def test_a_folder_without_sampling_fields_gives_none(tmp_path, caplog, config):
    with caplog.at_level(logging.INFO, logger="ponder.runtime"):
        assert sampling_defaults(folder(tmp_path, config)) == {}
    assert any("default sampling parameters: ponder's own" in r.getMessage() for r in caplog.records)


def test_the_tiny_models_saved_config_gives_none(tiny_llama):
    assert (tiny_llama / "generation_config.json").is_file()  # transformers saves token ids there
    assert sampling_defaults(ModelSource("tiny", str(tiny_llama))) == {}


def test_a_gguf_file_gives_none_even_beside_a_config(tmp_path):
    folder(tmp_path, QWEN25_INSTRUCT)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert sampling_defaults(ModelSource("m", str(tmp_path), "model.gguf")) == {}


def test_none_turns_them_off(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="ponder.runtime"):
        assert sampling_defaults(folder(tmp_path, QWEN25_INSTRUCT), "none") == {}
    assert any("ponder's own (model.generation_config = none)" in r.getMessage() for r in caplog.records)


def test_a_broken_file_costs_the_defaults_not_the_model(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults(ModelSource("m", str(tmp_path))) == {}


def test_an_unknown_mode_is_a_setting_error(tmp_path):
    with pytest.raises(SettingError, match="model.generation_config = 'vllm' is not one of auto, none"):
        sampling_defaults(folder(tmp_path, QWEN25_INSTRUCT), "vllm")
