"""The search-example benchmark on a tiny random model: it runs the documented search example's request
shape through the server's schema on a default-settings engine and accounts for every model step."""

from __future__ import annotations

import json

from bench import example as bench_example
from bench.simulate import LLAMA2_7B_PARAMETERS, llama2_7b_cost
from server.config import Settings


def test_the_request_is_the_one_the_server_makes():
    request = bench_example.example_request(bench_example.EXAMPLE, Settings.load(None), "r")
    assert (request.sampling.max_tokens, request.sampling.n, request.sampling.seed, request.sampling.temperature) \
        == (512, 2, 42, 0.8)
    search = request.search
    assert (search.strategy, search.n, search.beam_width, search.verifier, search.max_steps,
            search.max_step_tokens, search.step_delimiter) == ("beam", 16, 4, "judge", 40, 256, "\n\n")
    assert search.timeout_s == Settings.load(None).search.max_timeout_s


def test_quick_run_reports_the_search_and_its_model_steps(tiny_llama, tmp_path, capsys):
    out = tmp_path / "example.json"
    assert bench_example.main(["--model", str(tiny_llama), "--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    results = json.loads(printed[0])
    assert results == json.loads(out.read_text())
    assert printed[1].startswith("search example: ")
    assert results["request"] == bench_example.QUICK and results["deterministic"] is True  # auto, on this CPU
    assert results["tokens_generated"] > 0 and results["verifier_tokens_prefilled"] > 0
    # Every generated token came from a decode row or a prompt's last row (a path's first token).
    assert results["decode_rows"] <= results["tokens_generated"]
    assert results["decode_steps"] > 0 and results["prefill_steps"] >= 1
    assert results["decode_mean_batch"] == round(results["decode_rows"] / results["decode_steps"], 2)
    assert results["prefill_tokens"] >= results["verifier_tokens_prefilled"]
    # The same engine's plain n=16 rate, and the search's as a fraction of it.
    assert results["plain_16_tok_s"] > 0
    assert abs(results["vs_plain_16"] - results["tok_s"] / results["plain_16_tok_s"]) < 0.02  # both rounded
    # No schedule takes fewer decode steps than the longest path has tokens (its first came from the prompt).
    assert 0 < results["longest_path_tokens"] - 1 <= results["decode_steps"]
    assert results["plain_16_steps"] == -(-results["tokens_generated"] // 16)
    # The modelled 7B time: every decode step reads the 7B's fp16 weights (13.5 GB at 1 TB/s) at least.
    assert results["gpu_7b_decode_seconds"] >= round(results["decode_steps"] * 2 * LLAMA2_7B_PARAMETERS / 1e12, 2) - 0.01


def test_speculation_off_and_on_are_reported_side_by_side(tiny_llama, capsys):
    assert bench_example.main(["--model", str(tiny_llama), "--quick", "--speculative-extension", "both"]) == 0
    printed = capsys.readouterr().out.splitlines()
    results = json.loads(printed[0])
    off, on = results["speculation_off"], results["speculation_on"]
    assert (off["speculative_extension"], on["speculative_extension"]) == (False, True)
    assert off["speculative_tokens_used"] + off["speculative_tokens_adopted"] + off["speculative_tokens_discarded"] == 0
    keys = ("steps", "paths_explored", "longest_path_tokens", "output_digest")
    assert [off[k] for k in keys] == [on[k] for k in keys]  # the same search
    assert sum(line.startswith("search example: ") for line in printed) == 2


def test_the_verifier_and_length_can_be_changed(tiny_llama, capsys):
    results = bench_example.run(str(tiny_llama), True, verifier="confidence", max_tokens=12)
    assert results["request"]["search"]["verifier"] == "confidence" and results["request"]["max_tokens"] == 12
    assert results["verifier_tokens_prefilled"] == 0 and 0 < results["tokens_generated"] <= 12 * 2 * 4


def test_deterministic_runs_give_the_same_search(tiny_llama, capsys):
    runs = []
    for _ in range(2):
        assert bench_example.main(["--model", str(tiny_llama), "--quick", "--deterministic"]) == 0
        runs.append(json.loads(capsys.readouterr().out.splitlines()[0]))
    assert runs[0]["deterministic"] is True
    keys = ("tokens_generated", "verifier_tokens_prefilled", "steps", "paths_explored", "decode_rows", "prefill_tokens")
    assert [r[k] for r in runs for k in keys][:len(keys)] == [runs[1][k] for k in keys]


def test_the_gpu_model_prices_each_recorded_decode_step_by_the_roofline():
    from types import SimpleNamespace

    from bench.steps import StepLog, gpu_decode_seconds

    runner = SimpleNamespace(execute=lambda scheduled, copies, sampled, *rest: None)
    log = StepLog(runner)
    seq = lambda computed: SimpleNamespace(num_computed_tokens=computed)  # noqa: E731
    runner.execute([SimpleNamespace(num_new_tokens=1, seq=seq(99))], [], [0])  # one row attending 100 tokens
    runner.execute([SimpleNamespace(num_new_tokens=1, seq=seq(c)) for c in (99, 199, 299, 399)], [], [0, 1, 2, 3])
    runner.execute([SimpleNamespace(num_new_tokens=7, seq=seq(0))], [], [0])  # a prefill: not priced
    cost, peaks = llama2_7b_cost(16), bench_example.GPU
    assert log.decode_context == [100, 1000]
    assert gpu_decode_seconds(log, cost, peaks) == cost.decode_latency(peaks, 1, 100) + cost.decode_latency(peaks, 4, 250)
