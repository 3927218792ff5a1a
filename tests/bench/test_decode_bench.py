"""The decode benchmark on a tiny model: every requested system in one run, ratios to transformers,
bandwidth fractions, llama.cpp skipped with its reason (not a GGUF), JSON and a PNG."""

from __future__ import annotations

import json

import pytest
import torch

from bench import decode
from runtime.model.block_embedding import BlockEmbedding, HeadRowsEmbedding


def test_reports_each_system_against_transformers(tiny_llama, tmp_path, capsys):
    path = tmp_path / "decode.json"
    assert decode.main(["--model", str(tiny_llama), "--tokens", "4", "--parallel", "2",
                        "--systems", "default,int4,transformers,llama.cpp", "--prefill", "", "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    systems = {s["system"]: s for s in results["systems"]}
    assert list(systems) == ["default", "int4", "transformers"]
    assert results["llama_cpp_skipped"] == "the model is not a GGUF file"
    assert systems["transformers"]["vs_transformers_1"] == systems["transformers"]["vs_transformers_n"] == 1.0
    assert systems["default"]["setting"] == "model.quantize = auto: float (15 layers in ponder's float kernel (15 float32))"
    assert systems["default"]["weight_bytes"] == systems["transformers"]["weight_bytes"] > systems["int4"]["weight_bytes"]
    for s in systems.values():
        assert s["tokens_per_s_1"] > 0 and s["tokens_per_s_n"] > 0 and 0 < s["bandwidth_fraction_1"]
    assert results["read_bandwidth_gbs"] > 0
    assert results["plot"] == str(path.with_suffix(".png")) and path.with_suffix(".png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "llama.cpp skipped: the model is not a GGUF file" in out


def test_prefill_and_decode_of_the_default_against_the_opt_out(tiny_llama, tmp_path, capsys):
    """The default is batch-invariant (auto, on this CPU), the opt-out is not; each gets prompt
    tokens/s cold and half cached at every --prefill length, and the table prints their ratios."""
    path = tmp_path / "decode.json"
    assert decode.main(["--model", str(tiny_llama), "--tokens", "4", "--parallel", "2", "--repeats", "1",
                        "--systems", "default,not-invariant", "--prefill", "32,64", "--json", str(path)]) == 0
    systems = {s["system"]: s for s in json.loads(path.read_text())["systems"]}
    assert systems["default"]["invariant"] is True and systems["not-invariant"]["invariant"] is False
    for s in systems.values():
        assert list(s["prefill"]) == ["32_cold", "32_half_cached", "64_cold", "64_half_cached"]
        assert all(rate > 0 for rate in s["prefill"].values())
    out = capsys.readouterr().out
    assert "default / not-invariant" in out and "decode, default / not-invariant: 1 stream" in out


def test_an_unknown_system_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        decode.main(["--systems", "default,vllm"])
    assert exc.value.code == 2
    assert "--systems: unknown vllm" in capsys.readouterr().err


class _TiedToBlocks(torch.nn.Module):
    """A model whose token lookup has no table of its own: it reads the tied head's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.norm = torch.nn.Parameter(torch.ones(8))
        self.lookup = HeadRowsEmbedding(self.head, torch.float32)

    def get_input_embeddings(self):
        return self.lookup

    def get_output_embeddings(self):
        return self.head


def test_a_lookup_over_the_tied_head_s_blocks_counts_the_head_once():
    model = _TiedToBlocks()
    assert decode.step_weight_bytes(model) == (16 * 8 + 8) * 4


def test_an_untied_embedding_kept_in_blocks_is_not_a_step_s_read():
    model = _TiedToBlocks()
    model.lookup = BlockEmbedding("Q8_0", torch.zeros(16, 34, dtype=torch.uint8), 32, torch.float32)
    assert decode.step_weight_bytes(model) == (16 * 8 + 8) * 4
