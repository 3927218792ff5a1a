"""The head-wise offload benchmark's quick run: every reported field, the budget held, the bytes
into compute equal to the pieces loaded, and the same tokens as the resident decode and generate."""

from __future__ import annotations

import json

from bench import headwise


def test_quick_run_reports_its_figures_and_identical_outputs(tmp_path, capsys):
    path = tmp_path / "headwise.json"
    assert headwise.main(["--quick", "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    for field in ("model", "prompt_tokens", "new_tokens", "slices", "piece_bytes", "total_kv_bytes",
                  "budget_pieces", "budget_bytes", "offloaded", "resident", "transformers_generate",
                  "outputs_identical", "tokens"):
        assert field in results, field
    off = results["offloaded"]
    assert results["outputs_identical"] is True
    assert results["budget_fraction"] <= 0.125
    assert off["compute_bytes"] <= results["budget_bytes"]
    assert off["bytes_in"] == off["bytes_moved"]["host/compute"] \
        == off["pieces_loaded"] * results["piece_bytes"] > 0
    assert off["bytes_out"] == off["pieces_written"] * results["piece_bytes"]
    assert results["resident"]["bytes_in"] == 0
    for s in (off, results["resident"]):
        assert s["tokens_per_s"] > 0 and 0 <= s["stall_share"] <= 1
    assert len(results["tokens"]) == results["new_tokens"] == 16
    out = capsys.readouterr().out
    assert json.loads(out.splitlines()[0])["outputs_identical"] is True
    assert "outputs identical (offloaded, resident, generate): True" in out


def test_quick_run_with_a_small_host_tier_spills_to_disk(tmp_path):
    path = tmp_path / "headwise.json"
    assert headwise.main(["--quick", "--prompt", "256", "--tokens", "4", "--host-fraction", "0.25",
                          "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    off = results["offloaded"]
    assert results["disk_tier"] is True and results["outputs_identical"] is True
    moved = off["bytes_moved"]
    assert moved["disk/compute"] > 0 and moved["host/disk"] > 0
    assert moved["host/compute"] + moved["disk/compute"] == off["pieces_loaded"] * results["piece_bytes"]
