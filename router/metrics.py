"""The router's Prometheus metrics, in a registry of its own (served at ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

# From 1 ms (the tiny model on a CPU) to a minute (long prompts on a loaded GPU).
LATENCY_BUCKETS_S = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    60.0,
)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.requests = Counter(
            "splitserve_requests",
            "HTTP requests answered by the router, by route and status code.",
            ["route", "status"],
            registry=r,
        )
        self.replica_requests = Counter(
            "splitserve_replica_requests",
            "Generation requests sent to each engine replica.",
            ["replica", "role"],
            registry=r,
        )
        self.replica_in_flight = Gauge(
            "splitserve_replica_in_flight_requests",
            "Requests the router has in flight on each engine replica.",
            ["replica", "role"],
            registry=r,
        )
        self.ttft = Histogram(
            "splitserve_time_to_first_token_seconds",
            "Router-side time from request arrival to the first token, streamed requests.",
            ["mode", "prefill"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.itl = Histogram(
            "splitserve_inter_token_latency_seconds",
            "Router-side time between consecutive streamed tokens.",
            ["mode"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "splitserve_e2e_request_latency_seconds",
            "Router-side time from request arrival to the last token.",
            ["mode"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prefill_decisions = Counter(
            "splitserve_prefill_decisions",
            "Where each request's prompt was computed (local or remote) and why.",
            ["where", "reason"],
            registry=r,
        )
        self.engine_requests = Gauge(
            "splitserve_engine_requests",
            "Requests in each engine replica by state, as the engine last reported.",
            ["replica", "role", "state"],
            registry=r,
        )
        self.engine_kv_cache_usage = Gauge(
            "splitserve_engine_kv_cache_usage_ratio",
            "Share of each engine replica's KV cache in use (0 to 1).",
            ["replica", "role"],
            registry=r,
        )
        self.engine_stats_age = Gauge(
            "splitserve_engine_stats_age_seconds",
            "Age of the last scheduler report of each engine replica when polled.",
            ["replica", "role"],
            registry=r,
        )
        self.tokens = Counter(
            "splitserve_tokens",
            "Tokens processed, by kind (prompt or generation).",
            ["kind"],
            registry=r,
        )
