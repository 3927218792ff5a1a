"""`ponder bench kv --quick`, shrunk: its JSON line, JSON file and plot."""

import json

from bench import kv
from runtime.offload import POLICIES


def test_quick_benchmark_reports_every_field(tmp_path, capsys):
    path = tmp_path / "kv.json"
    args = ["--quick", "--beams", "4", "--steps", "2", "--step", "8", "--prompt", "32",
            "--threads", "1", "--json", str(path)]
    assert kv.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    printed = json.loads(out[0])
    assert out[1].startswith("kv offload benchmark")  # then the table
    saved = json.loads(path.read_text())
    for results in (printed, saved):
        assert set(results["policies"]) == set(POLICIES)
        for p in results["policies"].values():
            assert {"bytes_in", "bytes_prefetched", "seconds", "stall_share",
                    "groups_per_step"} <= set(p)
            assert 0 <= p["stall_share"] <= 1
        assert results["outputs_identical"] is True
        assert results["ratio_bytes"] == (results["policies"]["lbs"]["bytes_in"]
                                          / results["policies"]["token"]["bytes_in"])
        assert results["speedup"] > 0
        assert results["budget_blocks"] == results["total_kv_blocks"] // 4 == 3
    assert results["policies"]["token"]["bytes_in"] > 0
    assert len(saved["final_tokens"]) == 4 and all(len(t) == 17 for t in saved["final_tokens"])
    assert (tmp_path / "kv.png").stat().st_size > 0
