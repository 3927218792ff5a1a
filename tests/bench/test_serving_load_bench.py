"""The serving-load benchmark on a tiny model: ponder through HTTP at each client count, the
in-process stream beside it, llama-server skipped with its reason where it is not given."""

from __future__ import annotations

from bench import serving_load


def test_streams_reach_every_client_and_compare_with_the_engine_in_process(tiny_llama):
    results = serving_load.run(tiny_llama, [1, 3], requests=2, max_tokens=6, binary=None, threads=1)
    one, three = results["systems"]["ponder"]
    assert (one["clients"], one["requests"], three["clients"], three["requests"]) == (1, 2, 3, 6)
    assert one["tokens"] == 2 * 6 and three["tokens"] == 6 * 6  # ignore_eos: every stream runs to max_tokens
    assert one["tokens_per_s"] > 0 and one["ttft_p50_s"] > 0 and one["stream_tokens_per_s_p50"] > 0
    assert results["in_process_tokens_per_s_1"] > 0
    assert one["vs_in_process"] == round(one["stream_tokens_per_s_p50"] / results["in_process_tokens_per_s_1"], 2)
    assert "vs_in_process" not in three and "vs_llama_server" not in one
    assert results["llama_server_skipped"].startswith("no llama-server on PATH")
    text = serving_load.table(results)
    assert "llama-server skipped" in text and "vs in-process" in text
