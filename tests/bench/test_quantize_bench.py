"""The quantize benchmark on a tiny model: one row per mode, every field, perplexity above 1 and
the quantized perplexity close to the float one (random weights: near-uniform predictions)."""

from __future__ import annotations

import json

import pytest

from bench import quantize


def test_reports_speed_and_perplexity_per_mode(tiny_llama, tmp_path, capsys):
    path = tmp_path / "quantize.json"
    assert quantize.main(["--model", str(tiny_llama), "--tokens", "4", "--parallel", "2",
                          "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    assert [m["quantize"] for m in results["modes"]] == ["auto", "none", "int8", "int4"]
    assert results["text_tokens"] > 500
    auto, none, int8, int4 = results["modes"]
    assert auto["weight_bytes"] == none["weight_bytes"]  # a safetensors model: auto keeps float weights
    for m in results["modes"]:
        assert m["tokens_per_s_1"] > 0 and m["tokens_per_s_2"] > 0 and m["perplexity"] > 1
    assert none["weight_bytes"] > int8["weight_bytes"] > int4["weight_bytes"]
    assert abs(int8["perplexity"] / none["perplexity"] - 1) < 0.05
    out = capsys.readouterr().out
    assert "perplexity" in out and out.count("\n") >= 5


def test_an_unknown_mode_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        quantize.main(["--modes", "none,int3"])
    assert exc.value.code == 2
    assert "--modes: unknown mode(s) int3" in capsys.readouterr().err
