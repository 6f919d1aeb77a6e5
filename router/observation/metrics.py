"""The router's Prometheus metrics, in a registry of its own (served at ``/metrics``).

Every family but the API keys' carries a ``model`` label first: one router serves
several models, and each model's code writes through its own ``ModelMetrics``, which
fills that label in, so it never names its model per sample.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.metrics import MetricWrapperBase

from router.policies.qos import REFUSAL_REASONS
from router.settings import PRIORITIES
from splitserve import metric_catalogue as catalogue
from splitserve.metric_catalogue import Family, register


class RouterMetrics:
    """The router's families (``splitserve.metric_catalogue.ROUTER_FAMILIES``), each
    an attribute named as the catalogue names it, in lower case."""

    requests: Counter
    rejections: Counter
    priority_capped: Counter
    key_requests: Counter
    key_waiting: Gauge
    key_ttft: Histogram
    queue: Histogram
    replica_choices: Counter
    ttft_estimate: Gauge
    prefill_seconds_per_token: Gauge
    decode_step_seconds: Gauge
    prefix_cache_tokens: Counter
    prefix_estimate_error: Histogram
    replica_requests: Counter
    replica_in_flight: Gauge
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    prefill_decisions: Counter
    engine_requests: Gauge
    engine_kv_cache_usage: Gauge
    engine_prompt_tokens: Gauge
    engine_stats_age: Gauge
    traffic_drift: Gauge
    traffic_drifted: Gauge
    tokens: Counter

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        for attribute, family in ROUTER_ATTRIBUTES.items():
            setattr(self, attribute, register(family, self.registry))

    def for_model(self, model: str) -> ModelMetrics:
        return ModelMetrics(self, model)


# Each family's attribute on RouterMetrics (and ModelMetrics): its catalogue name, lower.
ROUTER_ATTRIBUTES = {
    name.lower(): family
    for name, family in vars(catalogue).items()
    if isinstance(family, Family) and family in catalogue.ROUTER_FAMILIES
}


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
        for reason in REFUSAL_REASONS:
            for priority in PRIORITIES:
                self.rejections.labels(reason, priority)  # present at 0 from the start

    def __getattr__(self, name: str) -> Any:
        # Only reached for a family RouterMetrics does not have: a typo, named as one.
        raise AttributeError(f"the router has no metric family {name!r}")
