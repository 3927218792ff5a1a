"""The time-budget benchmark on a tiny model: every configuration at every budget, with its bound."""

from __future__ import annotations

import json

import pytest

from bench import timeout


def test_reports_each_configuration_against_its_bound(tiny_llama, tmp_path, capsys):
    path = tmp_path / "timeout.json"
    assert timeout.main(["--model", str(tiny_llama), "--budgets", "1", "--max-tokens", "200", "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    rows = results["results"]
    assert [r["config"] for r in rows] == ["judge", "judge, small pool", "calculator"]
    for r in rows:
        assert r["timeout_s"] == 1 and r["bound_s"] == 1.6 and r["met"] == (r["seconds"] <= 1.6)
        assert r["tokens_generated"] > 0 and r["steps"] >= 1
    assert results["all_met"] == all(r["met"] for r in rows)
    assert "bound T x 1.1 + 0.5 s" in capsys.readouterr().out


def test_a_budget_under_one_second_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        timeout.main(["--budgets", "0.5"])
    assert exc.value.code == 2 and "--budgets" in capsys.readouterr().err
