"""Exact values of the exported metrics after sequences of events, read back from the exposition."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.wire.protocol import RuntimeStats
from server.metrics import GROUP_SIZE_BUCKETS, LATENCY_BUCKETS, Metrics


def samples(metrics: Metrics) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of everything exported, `_created` timestamps left out."""
    payload, _ = metrics.render()
    out = {}
    for family in text_string_to_metric_families(payload.decode()):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, frozenset(labels.items()))]


def has(metrics: Metrics, name: str, **labels: str) -> bool:
    return (name, frozenset(labels.items())) in samples(metrics)


def bucket_counts(metrics: Metrics, name: str) -> dict[float, float]:
    return {
        float(dict(labels)["le"]): v
        for (sample, labels), v in samples(metrics).items()
        if sample == f"{name}_bucket"
    }


def test_render_returns_text_exposition_and_its_content_type():
    payload, content_type = Metrics().render()
    assert isinstance(payload, bytes)
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    assert b"# TYPE ponder_requests_total counter" in payload


def test_instances_do_not_share_state():
    first, second = Metrics(), Metrics()
    first.request_finished("chat", 200, 0.1)
    first.set_runtime_up(True)
    assert value(first, "ponder_requests_total", endpoint="chat", status="200") == 1
    assert not has(second, "ponder_requests_total", endpoint="chat", status="200")
    assert value(second, "ponder_runtime_up") == 0


def test_fresh_metrics_export_zeros_for_known_labels():
    m = Metrics()
    for kind in ("prompt", "cached", "generated", "returned"):
        assert value(m, "ponder_tokens_total", kind=kind) == 0
    for outcome in ("used", "adopted", "discarded"):
        assert value(m, "ponder_speculative_tokens_total", outcome=outcome) == 0
    assert value(m, "ponder_runtime_up") == 0
    assert value(m, "ponder_runtime_restarts_total") == 0
    assert value(m, "ponder_request_latency_seconds_count") == 0


def test_requests_counted_by_endpoint_and_status_with_latency_histogram():
    m = Metrics()
    m.request_started("chat")
    m.request_started("chat")
    m.request_started("completion")
    assert value(m, "ponder_http_requests_in_flight", endpoint="chat") == 2
    m.request_finished("chat", 200, 0.3)
    m.request_finished("chat", "400", 0.004)
    m.request_finished("completion", 200, 90.0)
    assert value(m, "ponder_http_requests_in_flight", endpoint="chat") == 0
    assert value(m, "ponder_http_requests_in_flight", endpoint="completion") == 0
    assert value(m, "ponder_requests_total", endpoint="chat", status="200") == 1
    assert value(m, "ponder_requests_total", endpoint="chat", status="400") == 1
    assert value(m, "ponder_requests_total", endpoint="completion", status="200") == 1
    assert value(m, "ponder_request_latency_seconds_count") == 3
    assert value(m, "ponder_request_latency_seconds_sum") == pytest.approx(90.304)
    buckets = bucket_counts(m, "ponder_request_latency_seconds")
    assert buckets[0.005] == 1
    assert buckets[0.25] == 1
    assert buckets[0.5] == 2
    assert buckets[60.0] == 2
    assert buckets[120.0] == 3
    assert buckets[math.inf] == 3


def test_latency_buckets_span_milliseconds_to_minutes():
    assert LATENCY_BUCKETS[0] <= 0.005
    assert LATENCY_BUCKETS[-1] >= 600
    assert list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)
    assert GROUP_SIZE_BUCKETS[0] == 1 and GROUP_SIZE_BUCKETS[-1] == 256


def test_ttft_inter_token_and_returned_tokens():
    m = Metrics()
    m.observe_ttft(0.02)
    m.observe_ttft(1.5)
    for _ in range(4):
        m.observe_inter_token(0.008)
    m.add_returned_tokens(7)
    m.add_returned_tokens(3)
    m.add_returned_tokens(0)
    assert value(m, "ponder_time_to_first_token_seconds_count") == 2
    assert value(m, "ponder_time_to_first_token_seconds_sum") == pytest.approx(1.52)
    assert bucket_counts(m, "ponder_time_to_first_token_seconds")[0.025] == 1
    assert bucket_counts(m, "ponder_time_to_first_token_seconds")[2.5] == 2
    assert value(m, "ponder_inter_token_latency_seconds_count") == 4
    assert bucket_counts(m, "ponder_inter_token_latency_seconds")[0.005] == 0
    assert bucket_counts(m, "ponder_inter_token_latency_seconds")[0.01] == 4
    assert value(m, "ponder_tokens_total", kind="returned") == 10


def stats(**fields) -> RuntimeStats:
    return RuntimeStats(**fields)


def test_runtime_counters_advance_by_the_difference_of_cumulative_values():
    m = Metrics()
    m.apply_runtime_stats(stats(
        tokens_prompt=100, tokens_cached=32, tokens_generated=50,
        search_requests={"beam": 2}, search_paths=16, search_steps=9,
        speculative_tokens={"used": 10, "discarded": 4},
        kv_transfer_bytes={"device/host": 4096},
        prefix_query_tokens=100, prefix_hit_tokens=32, prefetch_stall_seconds=0.5,
    ))
    m.apply_runtime_stats(stats(
        tokens_prompt=150, tokens_cached=32, tokens_generated=80,
        search_requests={"beam": 3, "best_of_n": 1}, search_paths=24, search_steps=12,
        speculative_tokens={"used": 15, "discarded": 4},
        kv_transfer_bytes={"device/host": 8192, "host/disk": 1024},
        prefix_query_tokens=150, prefix_hit_tokens=48, prefetch_stall_seconds=1.25,
    ))
    assert value(m, "ponder_tokens_total", kind="prompt") == 150
    assert value(m, "ponder_tokens_total", kind="cached") == 32
    assert value(m, "ponder_tokens_total", kind="generated") == 80
    assert value(m, "ponder_search_requests_total", strategy="beam") == 3
    assert value(m, "ponder_search_requests_total", strategy="best_of_n") == 1
    assert value(m, "ponder_search_paths_total") == 24
    assert value(m, "ponder_search_steps_total") == 12
    assert value(m, "ponder_speculative_tokens_total", outcome="used") == 15
    assert value(m, "ponder_speculative_tokens_total", outcome="discarded") == 4
    assert value(m, "ponder_kv_transfer_bytes_total", src="device", dst="host") == 8192
    assert value(m, "ponder_kv_transfer_bytes_total", src="host", dst="disk") == 1024
    assert value(m, "ponder_kv_prefix_query_tokens_total") == 150
    assert value(m, "ponder_kv_prefix_hit_tokens_total") == 48
    assert value(m, "ponder_kv_prefetch_stall_seconds_total") == 1.25


def test_runtime_counters_do_not_mix_with_http_returned_tokens():
    m = Metrics()
    m.add_returned_tokens(5)
    m.apply_runtime_stats(stats(tokens_generated=20))
    m.apply_runtime_stats(stats(tokens_generated=20))
    assert value(m, "ponder_tokens_total", kind="returned") == 5
    assert value(m, "ponder_tokens_total", kind="generated") == 20


def test_a_dropped_cumulative_value_counts_as_the_increment():
    m = Metrics()
    m.apply_runtime_stats(stats(tokens_generated=100, search_paths=40,
                                kv_transfer_bytes={"host/device": 1000}))
    # The runtime started over without telling us: its counters are small again.
    m.apply_runtime_stats(stats(tokens_generated=30, search_paths=40,
                                kv_transfer_bytes={"host/device": 200}))
    assert value(m, "ponder_tokens_total", kind="generated") == 130
    assert value(m, "ponder_search_paths_total") == 40  # unchanged, not a reset
    assert value(m, "ponder_kv_transfer_bytes_total", src="host", dst="device") == 1200
    # Then it keeps counting up from its new base.
    m.apply_runtime_stats(stats(tokens_generated=45, search_paths=41,
                                kv_transfer_bytes={"host/device": 250}))
    assert value(m, "ponder_tokens_total", kind="generated") == 145
    assert value(m, "ponder_search_paths_total") == 41
    assert value(m, "ponder_kv_transfer_bytes_total", src="host", dst="device") == 1250


def test_after_a_restart_the_first_report_is_all_increment():
    m = Metrics()
    m.apply_runtime_stats(stats(tokens_generated=100))
    m.runtime_restarted()
    # Larger than before, yet every token of it is new: the new runtime counts from zero.
    m.apply_runtime_stats(stats(tokens_generated=120))
    assert value(m, "ponder_tokens_total", kind="generated") == 220
    assert value(m, "ponder_runtime_restarts_total") == 1
    m.runtime_restarted()
    assert value(m, "ponder_runtime_restarts_total") == 2


def test_runtime_gauges_take_the_latest_value_and_drop_vanished_tiers():
    m = Metrics()
    m.apply_runtime_stats(stats(
        requests_running=3, requests_waiting=5,
        kv_blocks={"device/used": 10, "device/cached": 4, "device/free": 50, "disk/free": 1000},
    ))
    m.apply_runtime_stats(stats(
        requests_running=1, requests_waiting=0,
        kv_blocks={"device/used": 2, "device/cached": 12, "device/free": 50},
    ))
    assert value(m, "ponder_requests_running") == 1
    assert value(m, "ponder_requests_waiting") == 0
    assert value(m, "ponder_kv_blocks", tier="device", state="used") == 2
    assert value(m, "ponder_kv_blocks", tier="device", state="cached") == 12
    assert value(m, "ponder_kv_blocks", tier="device", state="free") == 50
    assert not has(m, "ponder_kv_blocks", tier="disk", state="free")


def test_histogram_samples_are_observed_once_per_report():
    m = Metrics()
    m.apply_runtime_stats(stats(verifier_seconds=(0.004, 0.2), beam_group_sizes=(1, 3, 8)))
    m.apply_runtime_stats(stats(verifier_seconds=(0.02,), beam_group_sizes=(256,)))
    m.apply_runtime_stats(stats())
    assert value(m, "ponder_verifier_seconds_count") == 3
    assert value(m, "ponder_verifier_seconds_sum") == pytest.approx(0.224)
    assert bucket_counts(m, "ponder_verifier_seconds")[0.005] == 1
    assert bucket_counts(m, "ponder_verifier_seconds")[0.25] == 3
    assert value(m, "ponder_beam_group_size_count") == 4
    assert value(m, "ponder_beam_group_size_sum") == 268
    groups = bucket_counts(m, "ponder_beam_group_size")
    sizes = (1, 2, 4, 8, 128, 256)
    assert tuple(groups[s] for s in sizes) == (1, 1, 2, 3, 3, 4)


def test_runtime_up_and_down():
    m = Metrics()
    m.set_runtime_up(True)
    m.apply_runtime_stats(stats(requests_running=2, requests_waiting=7))
    assert value(m, "ponder_runtime_up") == 1
    m.set_runtime_up(False)
    assert value(m, "ponder_runtime_up") == 0
    assert value(m, "ponder_requests_running") == 0
    assert value(m, "ponder_requests_waiting") == 0


def test_model_info_names_only_the_current_model():
    m = Metrics()
    m.set_model_info("smollm2-135m", "float32", "cpu")
    m.set_model_info("qwen2.5-0.5b", "bfloat16", "cuda:0", "int4")
    current = {"model": "qwen2.5-0.5b", "dtype": "bfloat16", "device": "cuda:0", "quantize": "int4"}
    assert value(m, "ponder_model_info", **current) == 1
    assert not has(m, "ponder_model_info", model="smollm2-135m", dtype="float32", device="cpu")


def test_exported_names_are_exactly_the_documented_ones():
    m = Metrics()
    m.request_finished("chat", 200, 0.1)
    m.set_model_info("m", "float16", "cuda")
    m.apply_runtime_stats(stats(
        kv_blocks={"device/used": 1}, kv_transfer_bytes={"device/host": 1},
        search_requests={"beam": 1},
    ))
    names = {name for name, _ in samples(m)}
    expected = {
        "ponder_requests_total", "ponder_requests_running", "ponder_requests_waiting",
        "ponder_tokens_total", "ponder_search_requests_total", "ponder_search_paths_total",
        "ponder_search_steps_total", "ponder_speculative_tokens_total", "ponder_kv_blocks",
        "ponder_kv_transfer_bytes_total", "ponder_kv_prefix_query_tokens_total",
        "ponder_kv_prefix_hit_tokens_total", "ponder_kv_prefetch_stall_seconds_total",
        "ponder_runtime_up", "ponder_runtime_restarts_total", "ponder_model_info",
        "ponder_http_requests_in_flight",
    }
    for histogram in ("ponder_request_latency_seconds", "ponder_time_to_first_token_seconds",
                      "ponder_inter_token_latency_seconds", "ponder_verifier_seconds",
                      "ponder_beam_group_size"):
        expected |= {f"{histogram}_bucket", f"{histogram}_sum", f"{histogram}_count"}
    assert names == expected
