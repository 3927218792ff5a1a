"""Prometheus metrics of the HTTP process.

One `Metrics` per app, owning its own registry. The HTTP layer records its request events
directly; the runtime's view arrives as `RuntimeStats` messages whose counters are cumulative since
the runtime started. `apply_runtime_stats` turns those into monotonic Prometheus counters by
advancing each one by the difference from the last value seen. A cumulative value that drops
means the runtime started over, so the new value is the increment.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from runtime.wire.protocol import RuntimeStats

# Every name here is a legacy-valid one, so the classic text format is exact and every Prometheus
# version reads it (the library's own default when the scraper asks for nothing newer).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Whole requests and time to first token: a few milliseconds (cached, tiny) to many minutes (long
# tree searches on a small GPU).
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
    600.0, 1800.0,
)
# Per token and per verifier call: sub-millisecond to seconds.
STEP_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
)
GROUP_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

TOKEN_KINDS = ("prompt", "cached", "generated", "returned")
SPECULATIVE_OUTCOMES = ("used", "adopted", "discarded")  # kept by its path, by its children, dropped


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Last cumulative value seen per (counter, labels), under _lock.
        self._last_cumulative: dict[tuple[Counter, tuple[str, ...]], float] = {}
        # Label sets of ponder_kv_blocks in the latest report; tiers that vanish are dropped.
        self._kv_block_labels: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        r = self.registry

        # HTTP edge: every request, whatever answered it (auth, routing, validation, body limit)
        self.http_requests = Counter(
            "ponder_http_requests", "HTTP requests answered, by route template, method and status code.",
            ["route", "method", "status"], registry=r,
        )
        self.http_request_duration = Histogram(
            "ponder_http_request_duration_seconds", "Time from receiving an HTTP request to its last byte, "
            "by route template.", ["route"], buckets=LATENCY_BUCKETS, registry=r,
        )

        # Generation requests (chat and text completions that reached the runtime client)
        self.requests = Counter(
            "ponder_requests", "Generation requests answered, by endpoint and status code "
            "(499: the client went away).",
            ["endpoint", "status"], registry=r,
        )
        self.http_requests_in_flight = Gauge(
            "ponder_http_requests_in_flight", "HTTP requests being answered now.",
            ["endpoint"], registry=r,
        )
        self.request_latency = Histogram(
            "ponder_request_latency_seconds", "Time from receiving a request to its last byte.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            "ponder_time_to_first_token_seconds",
            "Time from receiving a request to its first token.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.inter_token = Histogram(
            "ponder_inter_token_latency_seconds", "Time between consecutive streamed tokens.",
            buckets=STEP_BUCKETS, registry=r,
        )
        self.tokens = Counter(
            "ponder_tokens", "Tokens by kind: prompt, cached (prompt tokens served from the prefix "
            "cache), generated (all paths of a search included), returned (sent to clients).",
            ["kind"], registry=r,
        )

        # Runtime gauges
        self.requests_running = Gauge(
            "ponder_requests_running", "Requests the runtime is generating for.", registry=r
        )
        self.requests_waiting = Gauge(
            "ponder_requests_waiting", "Requests queued in the runtime.", registry=r
        )
        self.kv_blocks = Gauge(
            "ponder_kv_blocks", "KV cache blocks by tier and state (used, cached, free).",
            ["tier", "state"], registry=r,
        )

        # Search
        self.search_requests = Counter(
            "ponder_search_requests", "Requests answered with tree search, by strategy.",
            ["strategy"], registry=r,
        )
        self.search_paths = Counter(
            "ponder_search_paths", "Search paths explored.", registry=r
        )
        self.search_steps = Counter(
            "ponder_search_steps", "Search steps taken.", registry=r
        )
        self.verifier_seconds = Histogram(
            "ponder_verifier_seconds", "Duration of one verifier call.",
            buckets=STEP_BUCKETS, registry=r,
        )
        self.speculative_tokens = Counter(
            "ponder_speculative_tokens", "Tokens generated ahead of a step boundary, by outcome.",
            ["outcome"], registry=r,
        )
        self.beam_group_size = Histogram(
            "ponder_beam_group_size", "Beams batched together in one forward pass.",
            buckets=GROUP_SIZE_BUCKETS, registry=r,
        )

        # KV cache
        self.kv_transfer_bytes = Counter(
            "ponder_kv_transfer_bytes", "Bytes of KV copied between tiers.",
            ["src", "dst"], registry=r,
        )
        self.kv_prefix_query_tokens = Counter(
            "ponder_kv_prefix_query_tokens", "Prompt tokens looked up in the prefix cache.",
            registry=r,
        )
        self.kv_prefix_hit_tokens = Counter(
            "ponder_kv_prefix_hit_tokens", "Prompt tokens found in the prefix cache.", registry=r
        )
        self.kv_prefetch_stall_seconds = Counter(
            "ponder_kv_prefetch_stall_seconds",
            "Seconds the engine waited for KV blocks to arrive from a slower tier.", registry=r,
        )

        # Runtime process
        self.runtime_up = Gauge(
            "ponder_runtime_up", "1 when the runtime process is ready, else 0.", registry=r
        )
        self.runtime_restarts = Counter(
            "ponder_runtime_restarts", "Times the runtime process was restarted.", registry=r
        )
        self.model_info = Gauge(
            "ponder_model_info", "The model being served (value is always 1).",
            ["model", "dtype", "device", "quantize"], registry=r,
        )

        # Known label values are exported from the start so that rates exist before the first event.
        for kind in TOKEN_KINDS:
            self.tokens.labels(kind)
        for outcome in SPECULATIVE_OUTCOMES:
            self.speculative_tokens.labels(outcome)

    # -- exposition ---------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE

    # -- HTTP side ----------------------------------------------------------------------------

    def http_request_finished(self, route: str, method: str, status: int, seconds: float) -> None:
        self.http_requests.labels(route, method, str(status)).inc()
        self.http_request_duration.labels(route).observe(seconds)

    def request_started(self, endpoint: str) -> None:
        self.http_requests_in_flight.labels(endpoint).inc()

    def request_finished(self, endpoint: str, status: int | str, latency_s: float) -> None:
        self.http_requests_in_flight.labels(endpoint).dec()
        self.requests.labels(endpoint, str(status)).inc()
        self.request_latency.observe(latency_s)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token.observe(seconds)

    def add_returned_tokens(self, n: int) -> None:
        if n > 0:
            self.tokens.labels("returned").inc(n)

    # -- runtime side -------------------------------------------------------------------------

    def apply_runtime_stats(self, stats: RuntimeStats) -> None:
        with self._lock:
            self.requests_running.set(stats.requests_running)
            self.requests_waiting.set(stats.requests_waiting)
            self._set_kv_blocks(_split_keys(stats.kv_blocks))

            self._advance(self.tokens, ("prompt",), stats.tokens_prompt)
            self._advance(self.tokens, ("cached",), stats.tokens_cached)
            self._advance(self.tokens, ("generated",), stats.tokens_generated)
            for strategy, total in stats.search_requests.items():
                self._advance(self.search_requests, (strategy,), total)
            self._advance(self.search_paths, (), stats.search_paths)
            self._advance(self.search_steps, (), stats.search_steps)
            for outcome, total in stats.speculative_tokens.items():
                self._advance(self.speculative_tokens, (outcome,), total)

            for labels, total in _split_keys(stats.kv_transfer_bytes).items():
                self._advance(self.kv_transfer_bytes, labels, total)
            self._advance(self.kv_prefix_query_tokens, (), stats.prefix_query_tokens)
            self._advance(self.kv_prefix_hit_tokens, (), stats.prefix_hit_tokens)
            self._advance(self.kv_prefetch_stall_seconds, (), stats.prefetch_stall_seconds)

            for seconds in stats.verifier_seconds:
                self.verifier_seconds.observe(seconds)
            for size in stats.beam_group_sizes:
                self.beam_group_size.observe(size)

    def set_runtime_up(self, is_up: bool) -> None:
        self.runtime_up.set(1 if is_up else 0)
        if not is_up:
            # A runtime that is gone runs and queues nothing; its last report must not linger.
            self.requests_running.set(0)
            self.requests_waiting.set(0)

    def runtime_restarted(self) -> None:
        with self._lock:
            self.runtime_restarts.inc()
            # The new runtime counts from zero: its first report is all increment, even where it
            # already exceeds what the old one had reached.
            self._last_cumulative.clear()

    def set_model_info(self, model: str, dtype: str, device: str, quantize: str = "none") -> None:
        self.model_info.clear()
        self.model_info.labels(model, dtype, device, quantize).set(1)

    def _set_kv_blocks(self, blocks: dict[tuple[str, str], int]) -> None:
        for labels in self._kv_block_labels - blocks.keys():
            self.kv_blocks.remove(*labels)
        for labels, count in blocks.items():
            self.kv_blocks.labels(*labels).set(count)
        self._kv_block_labels = set(blocks)

    def _advance(self, counter: Counter, labels: tuple[str, ...], cumulative: float) -> None:
        key = (counter, labels)
        previous = self._last_cumulative.get(key, 0)
        increment = cumulative - previous if cumulative >= previous else cumulative
        self._last_cumulative[key] = cumulative
        child = counter.labels(*labels) if labels else counter
        if increment > 0:
            child.inc(increment)


def _split_keys(values: dict[str, int]) -> dict[tuple[str, str], int]:
    """{"a/b": v} -> {("a", "b"): v}. A key without "/" keeps an empty second label rather than
    stopping the stats stream."""
    split = {}
    for key, value in values.items():
        first, _, second = key.partition("/")
        split[(first, second)] = value
    return split
