"""`ponder bench serving` end to end on a tiny model: every configuration returns the same tokens."""

import json

from bench import serving


def test_serving_bench_quick_reports_every_policy_with_identical_outputs(tiny_llama, tmp_path, capsys):
    path = tmp_path / "serving.json"
    assert serving.main(["--model", str(tiny_llama), "--quick", "--block-size", "4", "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    assert set(results["runs"]) == {"lbs roomy", "token pool", "lbs_no_prefix pool", "lbs pool", "lbs roomy +spec"}
    assert results["outputs_identical"] is True
    assert results["pool_blocks"] > 0 and results["peak_blocks"] > 0
    pool_runs = [results["runs"][f"{p} pool"] for p in ("token", "lbs_no_prefix", "lbs")]
    assert all(r["steps"] == results["runs"]["lbs roomy"]["steps"] for r in pool_runs)
    assert "outputs identical: True" in capsys.readouterr().out
