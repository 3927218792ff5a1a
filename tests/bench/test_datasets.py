"""`ponder bench accuracy --dataset`: the common JSONL shapes are read, graded with the search's own
equivalence, and a bad file stops the benchmark with one line naming the file and the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import accuracy
from bench.datasets import DatasetError, load_problems
from bench.problems import Problem

DATA = Path(__file__).resolve().parents[2] / "bench" / "data"
MATH500 = DATA / "math500-sample.jsonl"
GSM8K = DATA / "gsm8k-sample.jsonl"


def test_a_math500_file_keeps_latex_answers_and_levels():
    problems = load_problems(MATH500)
    assert [(p.level, p.answer) for p in problems] == [(1, "11"), (2, "\\frac{2}{3}"), (2, "7"), (3, "0.7"),
                                                       (3, "10")]
    assert problems[0].question == "What is $3 + 4 \\cdot 2$?"


def test_a_gsm8k_file_keeps_what_follows_the_hashes_without_commas():
    problems = load_problems(GSM8K)
    assert [p.answer for p in problems] == ["32", "33", "12000", "80"]
    assert all(p.level is None for p in problems)
    assert problems[1].question.startswith("A baker makes 9 trays")


def test_a_plain_file_and_numbers_as_answers(tmp_path):
    path = tmp_path / "plain.jsonl"
    path.write_text('{"question": "What is 2 + 2?", "answer": "4", "id": 7}\n\n'
                    '{"question": "Half of 9?", "answer": 4.5}\n')
    assert load_problems(path) == [Problem(None, "What is 2 + 2?", "4"), Problem(None, "Half of 9?", "4.5")]


def test_answers_are_graded_with_the_searchs_equivalence():
    fraction, decimal = load_problems(MATH500)[1], load_problems(MATH500)[3]
    assert accuracy.grade("\\frac{2}{3}", fraction) == "correct"
    assert accuracy.grade("2/3", fraction) == "correct"
    assert accuracy.grade("0.6", fraction) == "wrong"
    assert accuracy.grade("\\frac{7}{10}", decimal) == "correct"
    thousands = load_problems(GSM8K)[2]
    assert accuracy.grade("12000", thousands) == "correct" and accuracy.grade("1200", thousands) == "wrong"


@pytest.mark.parametrize(("text", "message"), [
    ('{"question": "a", "answer": "1"}\n{"question": "b", "answer": "2"\n',
     "line 2: not JSON (Expecting ',' delimiter at column 32)"),
    ('{"question": "a", "answer": "1"}\n\n["a", "1"]\n', "line 3: not a JSON object but list"),
    ('{"prompt": "a", "target": "1"}\n',
     "line 1: unknown shape (keys: prompt, target); expected MATH-500 (problem, answer), GSM8K (question, "
     "answer ending in '#### N') or plain (question, answer)"),
    ('{"question": "a", "answer": "so #### "}\n', "line 1: nothing after '####' in the answer"),
    ('{"question": "a", "answer": ""}\n', "line 1: 'answer' is empty"),
    ('{"problem": "a", "answer": ["1"]}\n', "line 1: 'answer' must be a string or a number, not list"),
    ('{"problem": "a", "answer": "1", "level": "hard"}\n', "line 1: level must be 1-9 or 'Level N', not 'hard'"),
])
def test_a_bad_line_stops_the_benchmark_with_one_line_naming_it(text, message, tmp_path, capsys, monkeypatch):
    path = tmp_path / "mine.jsonl"
    path.write_text(text)
    with pytest.raises(DatasetError, match="^" + str(path).replace(".", r"\.")):
        load_problems(path)
    monkeypatch.setattr(accuracy, "run", _no_run)
    assert accuracy.main(["--dataset", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"ponder bench accuracy: error: {path} {message}\n"


def test_an_empty_or_missing_file_is_one_line_too(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(accuracy, "run", _no_run)
    (tmp_path / "empty.jsonl").write_text("\n")
    assert accuracy.main(["--dataset", str(tmp_path / "empty.jsonl")]) == 2
    assert accuracy.main(["--dataset", str(tmp_path / "absent.jsonl")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"ponder bench accuracy: error: {tmp_path / 'empty.jsonl'}: no problems (expected one JSON object a line)",
        f"ponder bench accuracy: error: {tmp_path / 'absent.jsonl'}: cannot read: No such file or directory"]


def test_levels_and_limit_choose_the_problems(monkeypatch, capsys):
    seen = {}

    def fake_run(options, configs, problems, setup, progress=True, concurrency=1):
        seen["problems"], seen["configs"] = problems, configs
        raise SystemExit(0)

    monkeypatch.setattr(accuracy, "run", fake_run)
    with pytest.raises(SystemExit):
        accuracy.main(["--dataset", str(MATH500), "--levels", "2,3", "--limit", "3", "--methods", "beam",
                       "--n", "4", "--verifier", "judge"])
    assert [p.answer for p in seen["problems"]] == ["\\frac{2}{3}", "7", "0.7"]
    # greedy and majority at the same N run whatever --methods says: they are the baselines
    assert [(c.label, c.n) for c in seen["configs"]] == [("greedy", 1), ("majority", 4), ("beam:judge", 4)]
    assert accuracy.main(["--dataset", str(GSM8K), "--levels", "1"]) == 2
    assert capsys.readouterr().err == ("ponder bench accuracy: error: no problem of level 1; the set has levels "
                                       "none\n")


def test_a_config_names_the_generator_and_its_reward_models(tmp_path, monkeypatch, capsys):
    config = tmp_path / "ponder.toml"
    config.write_text('[model]\npath = "/models/gen"\ndevice = "cpu"\n\n'
                      '[verifiers.prm]\nkind = "qwen-prm"\npath = "/models/prm"\n')
    seen = {}

    def fake_run(options, configs, problems, setup, progress=True, concurrency=1):
        seen["options"], seen["configs"] = options, configs
        raise SystemExit(0)

    monkeypatch.setattr(accuracy, "run", fake_run)
    with pytest.raises(SystemExit):
        accuracy.main(["--config", str(config), "--dataset", str(GSM8K), "--methods", "best_of_n", "--verifier",
                       "prm", "--n", "4"])
    assert seen["options"].model == "/models/gen" and seen["options"].device == "cpu"
    assert seen["options"].verifiers == {"prm": {"kind": "qwen-prm", "path": "/models/prm",
                                                 "trust_remote_code": "false"}}
    assert [c.label for c in seen["configs"]] == ["greedy", "majority", "best_of_n:prm"]
    with pytest.raises(SystemExit):
        accuracy.main(["--config", str(config), "--model", "/models/other", "--dataset", str(GSM8K)])
    assert seen["options"].model == "/models/other"  # --model over the file, as `ponder serve`
    (tmp_path / "bad.toml").write_text('[model]\nquantize = "int3"\n')
    assert accuracy.main(["--config", str(tmp_path / "bad.toml")]) == 2
    assert accuracy.main(["--verifier", "prm"]) == 2  # no config: no reward model of that name
    assert capsys.readouterr().err.splitlines() == [
        f"ponder bench accuracy: error: {tmp_path / 'bad.toml'}: model.quantize: Input should be 'auto', 'none', "
        "'int8' or 'int4'",
        "ponder bench accuracy: error: unknown verifier 'prm'; expected one of judge, confidence, calculator"]


def test_a_tiny_model_answers_a_gsm8k_file_with_paired_statistics(tiny_llama, tmp_path, capsys):
    out = tmp_path / "gsm8k.json"
    config = tmp_path / "ponder.toml"
    config.write_text(f'[model]\npath = "{tiny_llama}"\ndevice = "cpu"\n')
    argv = ["--config", str(config), "--dataset", str(GSM8K), "--methods", "best_of_n", "--verifier", "confidence",
            "--n", "2", "--max-tokens", "6", "--json", str(out)]
    assert accuracy.main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    results = json.loads(printed[0])
    assert results == json.loads(out.read_text())
    assert (tmp_path / "gsm8k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results["dataset"] == str(GSM8K) and results["problems"] == 4 and results["levels"] == []
    assert results["gold"] == ["32", "33", "12000", "80"]
    assert [(r["label"], r["n"]) for r in results["results"]] == [
        ("greedy", 1), ("majority", 2), ("best_of_n:confidence", 2)]
    for row in results["results"]:
        assert len(row["statuses"]) == 4 and row["by_level"] == {}
        assert row["correct"] == row["statuses"].count("correct")
    compared = results["comparisons"]
    assert [(c["label"], c["n"], "vs_majority" in c) for c in compared] == [
        ("majority", 2, False), ("best_of_n:confidence", 2, True)]
    assert compared[1]["vs_majority"]["baseline"] == "majority N=2"
    for entry in compared:
        for cmp in (entry["vs_greedy"], entry.get("vs_majority", entry["vs_greedy"])):
            assert cmp["ci95"][0] <= cmp["difference"] <= cmp["ci95"][1] and 0 <= cmp["p_value"] <= 1
    assert printed[1].startswith(f"accuracy benchmark: {results['model']}, 4 problems ({GSM8K}; levels none")
    assert any(line.startswith("paired against greedy") for line in printed)
    assert printed[-1] == "no difference is significant at 0.05"  # four problems prove nothing


def _no_run(*args, **kwargs):
    raise AssertionError("the benchmark ran")
