"""The metric names dashboards and alert rules may read, from the code that defines them.

Shared by tests/dashboards/test_dashboard.py and test_alerts.py. Metrics the engines
record with ``ray.util.metrics`` (vLLM's, the utilization sampler's) have two names in a
Prometheus: Ray's (``ray_vllm_x``) and the one dashboards/prometheus.yml renames it to
(``vllm:x``); Ray Serve's own keep Ray's (``ray_serve_x``).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from prometheus_client import CollectorRegistry

from splitserve import metric_catalogue as catalogue

# vLLM's families the engine panels read (vllm/v1/metrics/loggers.py), by kind.
VLLM_KINDS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:prompt_tokens_by_source": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
}
# The utilization sampler's families (engines/sampler.py, through Ray), by kind.
SAMPLER_KINDS = {family.name: family.kind for family in catalogue.SAMPLER_FAMILIES}

# By any kind name: the callers below pass what a registry or Ray Serve's source calls it.
SUFFIXES: dict[str, tuple[str, ...]] = dict(catalogue.SUFFIXES.items())
# ray.util.metrics families in Ray Serve's source: Counter("serve_x", ...) and the like.
SERVE_FAMILY = re.compile(r'metrics\.(Counter|Gauge|Histogram)\(\s*(?:name=)?f?"(serve_[a-z_{}]+)"')
SERVE_PROTOCOLS = ("http", "grpc")  # request_ingress_metrics.py's {protocol_name}


def ray_name(name: str) -> str:
    """What Ray's metrics endpoint calls a ray.util.metrics family: ray_ and no ':'."""
    return "ray_" + name.replace(":", "_")


def exposed(family: str, kind: str) -> set[str]:
    """The series names Prometheus stores for one family."""
    return {family + suffix for suffix in SUFFIXES[kind]}


def ray_exported_names() -> set[str]:
    """vLLM's and the sampler's series under both of their names."""
    names: set[str] = set()
    for family, kind in (VLLM_KINDS | SAMPLER_KINDS).items():
        names |= exposed(family, kind) | exposed(ray_name(family), kind)
    return names


@cache
def serve_names() -> frozenset[str]:
    """Ray Serve's series as Ray's endpoint exports them, read from the installed ray."""
    import ray.serve

    names: set[str] = set()
    for path in Path(ray.serve.__file__).parent.rglob("*.py"):
        for kind, family in SERVE_FAMILY.findall(path.read_text()):
            for protocol in SERVE_PROTOCOLS:
                name = ray_name(family.replace("{protocol_name}", protocol))
                names |= exposed(name, kind.lower())
    return frozenset(names)


def registry_names(registry: CollectorRegistry) -> set[str]:
    """The series names a registry exposes (its collectors as they are now)."""
    names: set[str] = set()
    for family in registry.collect():
        names |= exposed(family.name, family.type if family.type in SUFFIXES else "gauge")
    return names


def code_names() -> set[str]:
    """Every series name the catalogue (splitserve/metric_catalogue.py), vLLM or Ray
    Serve defines: what a dashboard or alert may read."""
    return set(catalogue.series_of(catalogue.ALL_FAMILIES)) | ray_exported_names() | serve_names()
