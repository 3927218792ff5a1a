"""The search benchmark on a tiny random model: its baseline reads steps by the engine's rules, and a
quick run reports both systems over the same search shape."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from bench import search as bench_search


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    setup = bench_search.Setup(max_steps=3, max_step_tokens=4, max_tokens=6)
    return bench_search.BaselineSearch(model=None, tokenizer=tokenizer, judge=None,
                                       eos_ids={tokenizer.eos_token_id}, setup=setup)


def ids(baseline, *tokens: str) -> list[int]:
    return baseline.tokenizer.convert_tokens_to_ids(list(tokens))


def test_a_step_ends_at_the_delimiter_and_keeps_it(baseline):
    path = baseline.new_path()
    baseline.take_step(path, ids(baseline, "w1", "w2", "\n\n", "w3"), cap=4, is_last=False)
    assert path.token_ids == ids(baseline, "w1", "w2", "\n\n")
    assert path.steps == ["w1 w2"]
    assert not path.is_done


def test_a_step_ends_at_its_cap_and_the_last_step_ignores_the_delimiter(baseline):
    path = baseline.new_path()
    baseline.take_step(path, ids(baseline, "w1", "w2", "w3", "w4", "w5"), cap=4, is_last=False)
    assert path.token_ids == ids(baseline, "w1", "w2", "w3", "w4") and not path.is_done
    baseline.take_step(path, ids(baseline, "\n\n", "w6", "w7"), cap=2, is_last=True)
    assert path.token_ids == ids(baseline, "w1", "w2", "w3", "w4", "\n\n", "w6")
    assert path.is_done  # max_tokens (6) reached


def test_eos_and_an_empty_step_end_the_path(baseline):
    path = baseline.new_path()
    baseline.take_step(path, ids(baseline, "w1", "</s>", "<pad>"), cap=4, is_last=False)
    assert path.token_ids == ids(baseline, "w1", "</s>") and path.is_done
    empty = baseline.new_path()
    baseline.take_step(empty, ids(baseline, "\n\n", "w1"), cap=4, is_last=False)
    assert empty.token_ids == ids(baseline, "\n\n") and empty.is_done and empty.steps == [""]


def test_quick_run_reports_both_systems(tiny_llama, tmp_path, capsys):
    out = tmp_path / "search.json"
    assert bench_search.main(["--model", str(tiny_llama), "--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    results = json.loads(printed[0])
    assert results == json.loads(out.read_text())
    assert (results["prompts"], results["max_steps"], results["n"], results["beam_width"]) == (1, 3, 16, 4)
    for name in ("ponder", "baseline"):
        system = results[name]
        assert system["paths_returned"] == 16
        assert 0 < system["tokens_returned"] <= results["max_tokens"]
        assert system["tokens_generated"] >= system["tokens_returned"]
        assert system["goodput_tok_s"] == pytest.approx(system["tokens_returned"] / system["latency_s"], rel=0.05)
    # The baseline re-prefills every path and re-scores every step of it; ours prefills the prompt once.
    assert results["baseline"]["verifier_tokens_prefilled"] > results["ponder"]["verifier_tokens_prefilled"]
    assert results["baseline"]["generator_tokens_prefilled"] > results["ponder"]["generator_tokens_prefilled"]
    assert results["goodput_ratio"] == pytest.approx(
        results["ponder"]["goodput_tok_s"] / results["baseline"]["goodput_tok_s"], rel=0.05)
    assert any(line.startswith("goodput ratio") for line in printed)
    # ponder's decode steps with speculation off and on: the same searches, never fewer steps than
    # the longest path has tokens after its first (sampled from the prompt's logits).
    off, on = results["decode_steps"]["off"], results["decode_steps"]["on"]
    assert [p["answer"] for p in off] == [p["answer"] for p in on]
    assert [p["longest_path_tokens"] for p in off] == [p["longest_path_tokens"] for p in on]
    for problem in off + on:
        assert 0 < problem["longest_path_tokens"] - 1 <= problem["decode_steps"]
    assert any(line.startswith("ponder decode steps per search") for line in printed)
