"""The accuracy benchmark: its problem set is a function of the seed with right answers, its grader is the
search's answer equivalence, bad input stops it at once, and a run on a tiny model reports every
configuration with a plot."""

from __future__ import annotations

import json

import pytest

from bench import accuracy
from bench.problems import LEVELS, Problem, problem_set


def test_the_same_seed_gives_the_same_problems_and_another_seed_others():
    assert problem_set(7, 5) == problem_set(7, 5)
    assert problem_set(7, 5) != problem_set(8, 5)
    problems = problem_set(3, 4)
    assert [p.level for p in problems] == [level for level in LEVELS for _ in range(4)]
    assert len({p.question for p in problems}) > 15


def test_every_answer_is_what_its_question_states():
    for problem in problem_set(0, 40, levels=(1, 2, 3)):
        expression = problem.question.removeprefix("What is ").removesuffix("?")
        assert problem.answer == eval(expression)  # noqa: S307 - two integers and one operator
    for problem in problem_set(0, 40):
        assert problem.answer >= 0 and problem.gold == str(problem.answer)


# Each word-problem template of levels 6 and 7, read back: its numbers in order -> its answer.
WORD_TEMPLATES = [
    (r"has (\d+) \w+ and buys (\d+) more\.", lambda a, b: a + b),
    (r"has (\d+) \w+ and gives away (\d+)\.", lambda a, b: a - b),
    (r"has (\d+) \w+ with (\d+) \w+ in each\. How", lambda a, b: a * b),
    (r"shares (\d+) \w+ equally among (\d+) friends\.", lambda a, b: a / b),
    (r"has (\d+) \w+ with (\d+) \w+ in each and gives away (\d+)", lambda a, b, c: a * b - c),
    (r"gets (\d+) \w+ from one friend and (\d+) \w+ from another, then shares them equally among (\d+)",
     lambda a, b, c: (a + b) / c),
    (r"has (\d+) \w+, loses (\d+), and shares the rest equally among (\d+)", lambda a, b, c: (a - b) / c),
    (r"has (\d+) \w+ and buys (\d+) \w+ with (\d+) \w+ in each\.", lambda a, b, c: a + b * c),
]


def test_every_word_problem_of_levels_6_and_7_states_its_answer_and_each_template_occurs():
    import re

    seen = set()
    for problem in problem_set(5, 60, levels=(6, 7)):
        matched = [(i, m) for i, (pattern, _) in enumerate(WORD_TEMPLATES)
                   if (m := re.search(pattern, problem.question))]
        assert len(matched) == 1, problem.question
        index, match = matched[0]
        assert problem.answer == WORD_TEMPLATES[index][1](*map(int, match.groups())), problem.question
        assert problem.level == (6 if index < 4 else 7)
        seen.add(index)
    assert seen == set(range(len(WORD_TEMPLATES)))


def test_every_generated_answer_is_graded_correct():
    for problem in problem_set(1, 20):
        assert accuracy.grade(problem.gold, problem) == "correct"
        assert accuracy.grade(f"\\boxed{{{problem.answer}}}", problem) == "correct"


def test_the_grader_accepts_equivalent_forms_and_rejects_wrong_or_unreadable_answers():
    twelve = Problem(1, "What is 5 + 7?", 12)
    for form in ("12", "12.0", "\\boxed{12}", " 12 ", "$12$"):
        assert accuracy.grade(form, twelve) == "correct", form
    assert accuracy.grade("13", twelve) == "wrong"
    assert accuracy.grade("-12", twelve) == "wrong"
    assert accuracy.grade(None, twelve) == "unparsed"
    assert accuracy.grade("", twelve) == "unparsed"
    assert accuracy.grade("?", twelve) == "unparsed"
    assert accuracy.grade("\\frac{1}{", twelve) == "unparsed"


def test_wilson_interval():
    low, high = accuracy.wilson(8, 10)
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)
    assert accuracy.wilson(0, 10)[0] == 0.0 and accuracy.wilson(10, 10)[1] == pytest.approx(1.0)


def test_the_plan_runs_greedy_once_and_every_verified_method_per_verifier_and_n():
    configs = accuracy.plan(["greedy", "majority", "beam"], ["judge", "confidence"], [1, 4])
    assert [(c.label, c.n) for c in configs] == [
        ("greedy", 1), ("majority", 1), ("majority", 4), ("beam:judge", 1), ("beam:judge", 4),
        ("beam:confidence", 1), ("beam:confidence", 4)]


def test_greedy_and_majority_at_every_n_are_added_as_baselines():
    configs = accuracy.plan(["beam", "majority"], ["judge"], [4, 16])
    assert [(c.label, c.n) for c in accuracy.with_baselines(configs)] == [
        ("greedy", 1), ("majority", 4), ("majority", 16), ("beam:judge", 4), ("beam:judge", 16)]


def test_a_verifier_from_the_config_is_a_known_verifier():
    configs = accuracy.plan(["best_of_n"], ["prm"], [4], known_verifiers=("judge", "confidence", "prm"))
    assert [c.label for c in configs] == ["best_of_n:prm"]


@pytest.mark.parametrize(("args", "message"), [
    (["--methods", "greedy,sampling"], "unknown method 'sampling'; expected one of greedy, majority, "
                                       "best_of_n, beam, dvts, particle_filtering, deepconf"),
    (["--n", "4,0"], "N must be at least 1, got 0"),
    (["--n", "four"], "N must be a comma-separated list of integers, got 'four'"),
    (["--verifiers", "judge,oracle"], "unknown verifier 'oracle'; expected one of judge, confidence, calculator"),
    (["--levels", "2,8"], "unknown level 8; levels are 1, 2, 3, 4, 5, 6, 7"),
    (["--levels", "two"], "--levels must be a comma-separated list of integers, got 'two'"),
    (["--limit", "0"], "--limit must be at least 1, got 0"),
    (["--configs", "beam:calculator"], "--configs takes method[:verifier]@N, got 'beam:calculator'"),
    (["--configs", "beam@8"],
     "'beam@8': best_of_n, beam, dvts, particle_filtering take a verifier, greedy, majority and deepconf none"),
    (["--configs", "beam:oracle@8"], "unknown verifier 'oracle'; expected one of judge, confidence, calculator"),
    (["--concurrency", "0"], "--concurrency must be at least 1, got 0"),
    (["--concurrency", "4"], "--concurrency above 1 needs --deterministic: otherwise a problem's answer would "
                             "depend on the problems that share its batches"),
    (["--temperature", "0"], "--temperature must be in (0, 2], got 0.0"),
    (["--power", "--pilot", "/nonexistent/pilot.json"],
     "/nonexistent/pilot.json: cannot read the pilot: [Errno 2] No such file or directory: "
     "'/nonexistent/pilot.json'"),
])
def test_bad_input_stops_at_once_with_one_line(args, message, capsys, monkeypatch):
    def no_run(*a, **k):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(accuracy, "run", no_run)
    assert accuracy.main(["--model", "unused", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"ponder bench accuracy: error: {message}\n"


def test_a_tiny_model_run_reports_every_configuration_and_plots(tiny_llama, tmp_path, capsys):
    out = tmp_path / "accuracy.json"
    argv = ["--model", str(tiny_llama), "--methods", "greedy,majority,best_of_n,beam,dvts", "--verifiers",
            "judge,confidence", "--n", "1,4", "--per-level", "1", "--max-tokens", "8", "--json", str(out)]
    assert accuracy.main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    results = json.loads(printed[0])
    assert results == json.loads(out.read_text())
    assert (tmp_path / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results["problems"] == len(LEVELS) and results["levels"] == list(LEVELS)
    labels = [(r["label"], r["n"]) for r in results["results"]]
    assert labels == [("greedy", 1), ("majority", 1), ("majority", 4)] + [
        (f"{method}:{verifier}", n) for method in ("best_of_n", "beam", "dvts")
        for verifier in ("judge", "confidence") for n in (1, 4)]
    for row in results["results"]:
        assert row["correct"] + row["unparsed"] <= row["problems"] == len(LEVELS)
        assert 0.0 <= row["ci95"][0] <= row["accuracy"] <= row["ci95"][1] <= 1.0
        # the verifier methods add the greedy anchor's path to their N (8 tokens at most too)
        assert 0 < row["tokens_generated"] <= 8 * row["n"] + (row["anchor_tokens"] if row["verifier"] else 0)
        assert 0 <= row["anchor_tokens"] <= (8 if row["verifier"] else 0)
        assert len(row["answers"]) == len(LEVELS)
        if row["verifier"] == "judge" and row["method"] != "dvts":
            assert row["verifier_tokens"] > 0
        if row["verifier"] is None or row["verifier"] == "confidence":
            assert row["verifier_tokens"] == 0
        assert row["correct"] == row["statuses"].count("correct") and len(row["statuses"]) == len(LEVELS)
    compared = {(c["label"], c["n"]): c for c in results["comparisons"]}
    assert list(compared) == labels[1:]  # everything but greedy, in order
    assert "vs_majority" not in compared[("majority", 4)]
    assert compared[("beam:judge", 4)]["vs_majority"]["baseline"].startswith("majority N=")
    for entry in compared.values():
        for cmp in filter(None, (entry["vs_greedy"], entry.get("vs_majority"))):
            assert cmp["ci95"][0] <= cmp["difference"] <= cmp["ci95"][1]
            assert (cmp["verdict"] == "not significant") == (cmp["p_value"] >= 0.05)
    assert printed[1].startswith("accuracy benchmark:")
    assert any(line.startswith("paired against greedy and against majority voting") for line in printed)


def test_configs_add_single_configurations_to_the_grid():
    assert accuracy.parse_configs("beam:calculator@8, majority@8,greedy@1") == [
        accuracy.Config("beam", "calculator", 8), accuracy.Config("majority", None, 8),
        accuracy.Config("greedy", None, 1)]


def test_problems_asked_side_by_side_answer_as_they_do_one_at_a_time(tiny_llama, tmp_path, capsys):
    """--deterministic makes each request's tokens independent of its batch, so --concurrency changes the
    wall time and nothing else."""
    rows = {}
    for concurrency in (1, 3):
        out = tmp_path / f"c{concurrency}.json"
        argv = ["--model", str(tiny_llama), "--methods", "greedy,majority,best_of_n,beam", "--verifiers",
                "confidence,calculator", "--n", "4", "--per-level", "1", "--max-tokens", "8", "--deterministic",
                "--concurrency", str(concurrency), "--temperature", "1.0", "--json", str(out)]
        assert accuracy.main(argv) == 0
        results = json.loads(out.read_text())
        assert results["deterministic"] is True and results["concurrency"] == concurrency
        assert results["temperature"] == 1.0
        rows[concurrency] = [{k: r[k] for k in ("label", "n", "answers", "statuses", "tokens_generated")}
                             for r in results["results"]]
    capsys.readouterr()
    assert [(r["label"], r["n"]) for r in rows[1]] == [
        ("greedy", 1), ("majority", 4), ("best_of_n:confidence", 4), ("best_of_n:calculator", 4),
        ("beam:confidence", 4), ("beam:calculator", 4)]
    assert rows[3] == rows[1]


def test_power_prints_the_problems_a_comparison_needs_without_a_model(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(accuracy, "run", lambda *a, **k: pytest.fail("the benchmark ran"))
    assert accuracy.main(["--power", "--json", str(tmp_path / "power.json")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [(r["discordance"], r["connor"], r["exact"]) for r in json.loads(printed[0])["power"]] == [
        (0.15, 116, 122), (0.20, 155, 168), (0.25, 194, 207), (0.30, 234, 249)]
    assert printed[3].split() == ["15%", "116", "0.776", "122"]


def test_power_with_a_pilot_names_the_levels_to_run(tmp_path, capsys):
    greedy = {"label": "greedy", "method": "greedy", "n": 1, "tokens_generated": 30,
              "by_level": {"1": 0.9, "2": 0.6, "3": 0.3, "4": 0.1, "5": 0.0},
              "statuses": ["correct"] * 5 + ["wrong"] * 5}
    vote = {"label": "majority", "method": "majority", "n": 4, "tokens_generated": 120,
            "statuses": ["correct"] * 3 + ["wrong"] * 2 + ["correct"] * 2 + ["wrong"] * 3}
    pilot = tmp_path / "pilot.json"
    pilot.write_text(json.dumps({"results": [greedy, vote],
                                 "comparisons": accuracy.paired.comparisons([greedy, vote])}))
    assert accuracy.main(["--power", "--pilot", str(pilot)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2].endswith("levels where greedy is right on 20-70 %: 2,3 (run with --levels 2,3)")
    assert printed[-1] == "  majority N=4: discordance with greedy 40 %, problems needed 312"
