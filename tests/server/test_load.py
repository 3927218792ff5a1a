"""Concurrent streaming clients, plain and search, some dropped on purpose: nothing lost, nothing leaked."""

import pytest

from bench.load import LoadPlan, run_load
from tests.server.live import live_server

PLAN = LoadPlan(clients=8, requests_per_client=3, max_tokens=24, deadline_s=90.0)


@pytest.fixture(scope="module")
def server(tiny_llama):
    env = {"PONDER_CACHE__NUM_BLOCKS": "1024", "PONDER_CACHE__BLOCK_SIZE": "4", "PONDER_SERVER__LOG_LEVEL": "WARNING"}
    with live_server("--model", str(tiny_llama), "--device", "cpu", env=env) as (base, _):
        yield base


def test_eight_concurrent_clients_lose_nothing_and_leave_the_kv_pool_idle(server):
    report = run_load(server, PLAN)
    assert report["failures"] == []
    assert report["errors"] == 0 and report["lost_or_truncated"] == 0
    # Requests 1, 6, 11, 16 and 21 are dropped; 6 and 21 are search requests, dropped mid-search.
    assert report["dropped"] == 5 and report["completed"] == PLAN.num_requests - 5
    assert report["by_kind"]["search"]["completed"] == 6 and report["by_kind"]["plain"]["completed"] == 13
    # Plain streams run to max_tokens (ignore_eos); search answers are at most max_tokens long.
    assert 13 * 24 < report["completion_tokens"] <= 19 * 24
    assert report["server_statuses"] == {"200": 19, "499": 5}
    assert report["idle_after"]["kv_used[cpu]"] == 0
    assert report["idle_after"]["ponder_requests_running"] == 0 and report["idle_after"]["in_flight[chat]"] == 0
    assert report["ttft_p50_s"] <= report["ttft_p99_s"] and report["latency_p50_s"] <= report["latency_p99_s"]
