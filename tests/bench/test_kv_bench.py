"""`ponder bench kv` on a tiny model: every policy of the served engine runs the same search under
a budget of a quarter of its distinct KV, with the same tokens as the resident run."""

import json
import math

from bench import kv


def test_kv_bench_reports_every_policy_on_the_served_engine(tiny_llama, tmp_path, capsys):
    path = tmp_path / "kv.json"
    args = ["--model", str(tiny_llama), "--paths", "4", "--steps", "2", "--step", "8", "--prompt", "24",
            "--block-size", "4", "--threads", "1", "--disk-dir", str(tmp_path), "--json", str(path)]
    assert kv.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert json.loads(out[0]) == json.loads(path.read_text())
    assert out[1].startswith("kv offload benchmark (served engine)")
    r = json.loads(path.read_text())
    assert set(r["policies"]) == {"token", "lbs_no_prefix", "lbs"}
    distinct = r["distinct_kv_blocks"]
    assert distinct == r["resident"]["peak_blocks"] > 0
    one_path = math.ceil((24 + 16) / 4) + 1
    assert r["budget_blocks"] == max(math.ceil(distinct / 4), one_path) < distinct
    assert r["host_blocks"] == distinct // 4 and r["host_bytes"] == r["host_blocks"] * r["block_bytes"]
    assert r["disk_read_path"][0] in ("o_direct", "fadvise_dontneed")
    for p in r["policies"].values():
        assert p["outputs_identical"] is True
        assert p["bytes_into_compute"] == sum(v for k, v in p["bytes_moved"].items() if k.endswith("->compute"))
        assert 0 <= p["stall_share"] <= 1 and p["tokens_per_s"] > 0
    token, lbs = r["policies"]["token"], r["policies"]["lbs"]
    assert token["bytes_into_compute"] > 0
    assert r["ratio_bytes"] == lbs["bytes_into_compute"] / token["bytes_into_compute"]
    assert r["speedup"] == round(token["seconds"] / lbs["seconds"], 3)
    assert r["outputs_identical"] is True
    assert "outputs identical across policies and the resident run: True" in out
