"""The router's Prometheus metrics, in a registry of its own (served at ``/metrics``).

Every family but the API keys' carries a ``model`` label first: one router serves
several models, and each model's code writes through its own ``ModelMetrics``, which
fills that label in, so it never names its model per sample.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.metrics import MetricWrapperBase

from router.settings import PRIORITIES

# key_queue_full: an API key's own cap (router/http/auth.py).
REJECTION_REASONS = ("queue_full", "ttft_slo", "key_queue_full")

# Zero (the signal was right), then whole blocks (16 tokens on GPUs, 128 on vLLM's CPU
# backend) up to a long prompt.
PREFIX_ERROR_BUCKETS = (0.5, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

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
# Finer where inter-token gaps live (0.5 to 50 ms), so that a p50 read from the
# histogram can be set against a client's (bench/itl_agreement.py).
ITL_BUCKETS_S = (
    0.0005,
    0.001,
    0.0015,
    0.002,
    0.0025,
    0.003,
    0.004,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    5.0,
)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.requests = Counter(
            "splitserve_requests",
            "HTTP requests answered by the router, by route, status code and priority.",
            ["model", "route", "status", "priority"],
            registry=r,
        )
        self.rejections = Counter(
            "splitserve_rejections",
            "Requests refused by admission control, by reason and priority.",
            ["model", "reason", "priority"],
            registry=r,
        )
        self.priority_capped = Counter(
            "splitserve_priority_capped",
            "Requests served at a lower priority than they asked for, because their API key"
            " allows no higher: by the key's configured name (never the key), the priority"
            " requested and the one granted.",
            ["key", "requested", "granted"],
            registry=r,
        )
        self.queue = Histogram(
            "splitserve_queue_seconds",
            "Router-side time from request arrival until an engine accepted it.",
            ["model", "shape"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.replica_choices = Counter(
            "splitserve_replica_choices",
            "Replica choices per pool, by policy, chosen replica and why.",
            ["model", "pool", "policy", "replica", "reason"],
            registry=r,
        )
        self.ttft_estimate = Gauge(
            "splitserve_ttft_estimate_seconds",
            "The latest time-to-first-token estimate admission control made, per replica"
            " that would compute the prompt.",
            ["model", "replica"],
            registry=r,
        )
        self.prefill_seconds_per_token = Gauge(
            "splitserve_prefill_seconds_per_token",
            "The router's moving average of seconds of time to first token per prefill token"
            " queued or computed, per replica (seeded by the calibration prefill).",
            ["model", "replica"],
            registry=r,
        )
        self.decode_step_seconds = Gauge(
            "splitserve_decode_step_seconds",
            "The router's moving average of seconds between tokens, per replica.",
            ["model", "replica"],
            registry=r,
        )
        self.prefix_cache_tokens = Counter(
            "splitserve_prefix_cache_tokens",
            "Prompt tokens found in a replica's prefix cache: as the router estimated before"
            " routing (estimated: the signal it routed by; kv_events, mirror: each signal),"
            " and as vLLM reported for the same requests (reported).",
            ["model", "replica", "source"],
            registry=r,
        )
        self.prefix_estimate_error = Histogram(
            "splitserve_prefix_estimate_error_tokens",
            "Per request, how far each prefix signal's cached-token count was from what vLLM"
            " found (absolute, tokens).",
            ["model", "signal"],
            buckets=PREFIX_ERROR_BUCKETS,
            registry=r,
        )
        self.replica_requests = Counter(
            "splitserve_replica_requests",
            "Generation requests sent to each engine replica.",
            ["model", "replica", "role"],
            registry=r,
        )
        self.replica_in_flight = Gauge(
            "splitserve_replica_in_flight_requests",
            "Requests the router has in flight on each engine replica.",
            ["model", "replica", "role"],
            registry=r,
        )
        self.ttft = Histogram(
            "splitserve_time_to_first_token_seconds",
            "Router-side time from request arrival to the first token, streamed requests.",
            ["model", "shape", "prefill"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.itl = Histogram(
            "splitserve_inter_token_latency_seconds",
            "Router-side time between consecutive streamed tokens.",
            ["model", "shape"],
            buckets=ITL_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "splitserve_e2e_request_latency_seconds",
            "Router-side time from request arrival to the last token.",
            ["model", "shape"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prefill_decisions = Counter(
            "splitserve_prefill_decisions",
            "Where each request's prompt was computed (local or remote) and why.",
            ["model", "where", "reason"],
            registry=r,
        )
        self.engine_requests = Gauge(
            "splitserve_engine_requests",
            "Requests in each engine replica by state, as the engine last reported.",
            ["model", "replica", "role", "state"],
            registry=r,
        )
        self.engine_kv_cache_usage = Gauge(
            "splitserve_engine_kv_cache_usage_ratio",
            "Share of each engine replica's KV cache in use (0 to 1).",
            ["model", "replica", "role"],
            registry=r,
        )
        self.engine_prompt_tokens = Gauge(
            "splitserve_engine_prompt_tokens",
            "Prompt tokens each engine replica has processed since it started, by where their"
            " KV came from (vLLM's sources: local_compute, local_cache_hit,"
            " external_kv_transfer), as the engine last reported; a counter inside the engine.",
            ["model", "replica", "role", "source"],
            registry=r,
        )
        self.engine_stats_age = Gauge(
            "splitserve_engine_stats_age_seconds",
            "Age of the last scheduler report of each engine replica when polled.",
            ["model", "replica", "role"],
            registry=r,
        )
        self.traffic_drift = Gauge(
            "splitserve_traffic_drift_ratio",
            "Live traffic (the last router.traffic_profile.window_requests answered requests)"
            " over the traffic profile the split was chosen for, by quantity (prompt_tokens,"
            " output_tokens, request_rate); 1 is as profiled.",
            ["model", "quantity"],
            registry=r,
        )
        self.traffic_drifted = Gauge(
            "splitserve_traffic_drifted",
            "1 while the quantity's drift ratio is outside router.traffic_profile.tolerance.",
            ["model", "quantity"],
            registry=r,
        )
        self.tokens = Counter(
            "splitserve_tokens",
            "Tokens processed, by kind (prompt or generation).",
            ["model", "kind"],
            registry=r,
        )

    def for_model(self, model: str) -> ModelMetrics:
        return ModelMetrics(self, model)


class ModelLabelled:
    """A metric family seen from one model: ``labels`` takes the other labels only."""

    def __init__(self, family: MetricWrapperBase, model: str) -> None:
        self._family = family
        self._model = model

    def labels(self, *values: str) -> Any:
        return self._family.labels(self._model, *values)


class ModelMetrics:
    """The router's metrics as one model's code writes them: the same names as
    ``RouterMetrics``, with the ``model`` label already set."""

    def __init__(self, families: RouterMetrics, model: str) -> None:
        self.model = model
        self.registry = families.registry
        for name, family in vars(families).items():
            if isinstance(family, MetricWrapperBase):
                labelled = "model" in family._labelnames
                setattr(self, name, ModelLabelled(family, model) if labelled else family)
        for reason in REJECTION_REASONS:
            for priority in PRIORITIES:
                self.rejections.labels(reason, priority)  # present at 0 from the start

    def __getattr__(self, name: str) -> Any:
        # Only reached for a family RouterMetrics does not have: a typo, named as one.
        raise AttributeError(f"the router has no metric family {name!r}")
