"""The Grafana dashboard, written as code: ``python -m dashboards.dashboard`` regenerates
``dashboards/splitserve.json`` (the tests check the committed file matches).

Rows: the client's view (load generator), the router, the engines (vLLM's own metrics,
per replica and role), Ray Serve's replicas and errors, KV transfer (PD), QoS, and
utilization with the per-GPU imbalance. Every panel reads the Prometheus datasource
chosen in ``$datasource``. Names come from router/observation/metrics.py,
kv_transfer/metrics.py, loadgen/outputs/exposition.py, engines/sampler.py, vLLM and Ray Serve.

What the engines record with ``ray.util.metrics`` (vLLM's metrics, the utilization
sampler) reaches Prometheus from Ray's per-node endpoint as ``ray_vllm_x`` and
``ray_splitserve_x``. dashboards/prometheus.yml renames them back to ``vllm:x`` and
``splitserve_x``; a Prometheus that scrapes Ray's endpoint as it is (Ray's own config, a
plain PodMonitor) keeps Ray's names. Those panels read both (``either``).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve import metric_catalogue as c

DASHBOARD_PATH = Path(__file__).with_name("splitserve.json")
DASHBOARD_UID = "splitserve"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
PANEL_WIDTH, PANEL_HEIGHT, GRID_WIDTH = 8, 8, 24

# Template variables: which run of the load generator, which served model (the router's
# metrics carry it), which router shape, which replicas.
RUN = 'run=~"$run"'
MODEL = 'model=~"$model"'
SHAPE = f'{MODEL}, shape=~"$shape"'
REPLICA = 'replica=~"$replica"'
ROUTER_REPLICA = f"{MODEL}, {REPLICA}"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    targets: tuple[Target, ...]


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def rate_by(metric: str, selector: str, by: str) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}[{RATE}]))"


def ray_exported(name: str) -> str:
    """The name Ray's metrics endpoint gives what an engine records as ``name``."""
    return "ray_" + name.replace(":", "_")


def either(name: str, query: Callable[[str], str]) -> str:
    """``query`` over the relabelled name, or else over Ray's own.

    Both sides aggregate to the same labels, so ``or`` keeps one series per label set
    (the relabelled one where a Prometheus holds both); a ``{__name__=~"a|b"}`` selector
    would instead fail on duplicate series once rate() drops the names.
    """
    return f"({query(name)} or {query(ray_exported(name))})"


def engine_rate_by(metric: str, selector: str, by: str) -> str:
    return either(metric, lambda name: rate_by(name, selector, by))


def engine_gauge(aggregation: str, metric: str, by: str) -> str:
    return either(metric, lambda name: f"{aggregation} by ({by}) ({name}{{{REPLICA}}})")


Rates = Callable[[str, str, str], str]  # (metric, selector, by) -> summed rates


def latency(
    title: str, description: str, bucket: str, selector: str, by: str, rates: Rates = rate_by
) -> Panel:
    """p50 and p95 from a histogram's buckets over the panel's rate window."""
    buckets = rates(bucket, selector, f"le, {by}")
    return Panel(
        title,
        description,
        "s",
        (
            Target(f"histogram_quantile(0.5, {buckets})", f"p50 {{{{{by}}}}}"),
            Target(f"histogram_quantile(0.95, {buckets})", f"p95 {{{{{by}}}}}"),
        ),
    )


def legend(labels: str) -> str:
    return " ".join(f"{{{{{label.strip()}}}}}" for label in labels.split(","))


PREFIX_QUERIES = engine_rate_by("vllm:prefix_cache_queries_total", REPLICA, "replica, role")
PREFIX_HITS = engine_rate_by("vllm:prefix_cache_hits_total", REPLICA, "replica, role")

CLIENT = Row(
    "Client view (load generator)",
    (
        latency(
            "Client TTFT",
            "Time to first token as the client saw it.",
            c.LOADGEN_TTFT.bucket,
            RUN,
            "shape",
        ),
        latency(
            "Client ITL",
            "Gaps between consecutive tokens as the client saw them.",
            c.LOADGEN_ITL.bucket,
            RUN,
            "shape",
        ),
        latency(
            "Client TPOT",
            "Per request (last - first token) / (n - 1).",
            c.LOADGEN_TPOT.bucket,
            RUN,
            "shape",
        ),
        Panel(
            "Client requests by outcome",
            "Finished requests per second: ok, rejected (503/429), error.",
            "reqps",
            (
                Target(
                    rate_by(c.LOADGEN_REQUESTS.total, RUN, "shape, outcome"),
                    legend("shape, outcome"),
                ),
            ),
        ),
        Panel(
            "Client tokens per second",
            "Input and output tokens of completed requests.",
            "short",
            (Target(rate_by(c.LOADGEN_TOKENS.total, RUN, "shape, kind"), legend("shape, kind")),),
        ),
        Panel(
            "Client in flight and target QPS",
            "Requests sent and not done; the run's target rate (inf shows as +Inf).",
            "short",
            (
                Target(
                    f"sum by (shape) ({c.LOADGEN_IN_FLIGHT.name}{{{RUN}}})", "in flight {{shape}}"
                ),
                Target(
                    f"max by (shape) ({c.LOADGEN_TARGET_QPS.name}{{{RUN}}})",
                    "target QPS {{shape}}",
                ),
            ),
        ),
        latency(
            "Client send lag",
            "Actual minus scheduled send time: a large lag means the client, not the"
            " server, is the bottleneck.",
            c.LOADGEN_SEND_LAG.bucket,
            RUN,
            "shape",
        ),
    ),
)

ROUTER = Row(
    "Router",
    (
        Panel(
            "Requests by route and status",
            "HTTP requests the router answered per second.",
            "reqps",
            (
                Target(
                    rate_by(c.REQUESTS.total, MODEL, "model, route, status"),
                    legend("model, route, status"),
                ),
            ),
        ),
        latency(
            "Server TTFT by prefill place",
            "Router arrival to first token; prefill=remote is PD's prefill replica.",
            c.TTFT.bucket,
            SHAPE,
            "model, shape, prefill",
        ),
        latency(
            "Server ITL",
            "Router-side gap between streamed tokens.",
            c.ITL.bucket,
            SHAPE,
            "shape",
        ),
        latency(
            "Server end-to-end",
            "Router arrival to last token.",
            c.E2E.bucket,
            SHAPE,
            "shape",
        ),
        latency(
            "Queue time",
            "Router arrival until an engine accepted the request.",
            c.QUEUE.bucket,
            SHAPE,
            "shape",
        ),
        Panel(
            "Replica choices",
            "Which replica the policy chose, per pool, per second.",
            "reqps",
            (
                Target(
                    rate_by(c.REPLICA_CHOICES.total, MODEL, "pool, policy, replica"),
                    legend("pool, policy, replica"),
                ),
            ),
        ),
        Panel(
            "In flight per replica",
            "Requests the router has in flight on each engine replica.",
            "short",
            (
                Target(
                    f"sum by (replica, role) ({c.REPLICA_IN_FLIGHT.name}{{{ROUTER_REPLICA}}})",
                    legend("replica, role"),
                ),
            ),
        ),
        Panel(
            "Engine queues as the router polls them",
            "Every 200 ms the router reads each engine's scheduler: running and waiting.",
            "short",
            (
                Target(
                    f"sum by (replica, state) ({c.ENGINE_REQUESTS.name}{{{ROUTER_REPLICA}}})",
                    legend("replica, state"),
                ),
            ),
        ),
        Panel(
            "Tokens per second (router)",
            "Prompt and generated tokens the router counted.",
            "short",
            (Target(rate_by(c.TOKENS.total, MODEL, "model, kind"), legend("model, kind")),),
        ),
    ),
)

ENGINES = Row(
    "Engines (vLLM, per replica and role)",
    (
        Panel(
            "Running and waiting requests",
            "vLLM's scheduler, per replica.",
            "short",
            (
                Target(
                    engine_gauge("sum", "vllm:num_requests_running", "replica, role"),
                    "running {{replica}} ({{role}})",
                ),
                Target(
                    engine_gauge("sum", "vllm:num_requests_waiting", "replica, role"),
                    "waiting {{replica}} ({{role}})",
                ),
            ),
        ),
        Panel(
            "KV cache usage",
            "Share of each replica's KV cache in use.",
            "percentunit",
            (
                Target(
                    engine_gauge("max", "vllm:kv_cache_usage_perc", "replica, role"),
                    legend("replica, role"),
                ),
            ),
        ),
        Panel(
            "Prefix cache hit rate",
            "Prompt tokens found in the prefix cache over tokens looked up.",
            "percentunit",
            (
                # vLLM's Ray counters skip inc(0): no hits yet means no hits series, so
                # count those replicas as 0 hits instead of showing no data.
                Target(
                    f"({PREFIX_HITS} or 0 * {PREFIX_QUERIES}) / {PREFIX_QUERIES}",
                    legend("replica, role"),
                ),
            ),
        ),
        latency(
            "Engine TTFT",
            "vLLM's own time to first token (engine arrival to first token).",
            "vllm:time_to_first_token_seconds_bucket",
            REPLICA,
            "replica",
            engine_rate_by,
        ),
        latency(
            "Engine TPOT",
            "vLLM's per-request time per output token (decode replicas).",
            "vllm:request_time_per_output_token_seconds_bucket",
            REPLICA,
            "replica",
            engine_rate_by,
        ),
        Panel(
            "Engine tokens per second",
            "Prompt and generated tokens, per replica.",
            "short",
            (
                Target(
                    engine_rate_by("vllm:prompt_tokens_total", REPLICA, "replica"),
                    "prompt {{replica}}",
                ),
                Target(
                    engine_rate_by("vllm:generation_tokens_total", REPLICA, "replica"),
                    "generation {{replica}}",
                ),
            ),
        ),
        Panel(
            "Prompt tokens by source",
            "Computed locally, found in the local prefix cache, or loaded from a KV"
            " transfer (PD's decode replicas).",
            "short",
            (
                Target(
                    engine_rate_by(
                        "vllm:prompt_tokens_by_source_total", REPLICA, "replica, source"
                    ),
                    legend("replica, source"),
                ),
            ),
        ),
    ),
)

# Ray Serve's own metrics (ray/serve/_private: deployment_state.py, replica.py,
# request_ingress_metrics.py), exported by Ray's endpoint under these names as they are.
SERVE_BY = "application, deployment"
# With per-replica series (Serve's default) a replica's gauge is 1 while healthy and 0 once
# stopped; otherwise one series per deployment holds the count: the sum is the count either way.
SERVE_HEALTHY = f"sum by ({SERVE_BY}) (ray_serve_deployment_replica_healthy)"


def serve_errors(counter: str, by: str) -> str:
    """Errors per second, or 0 for a live deployment without any: Ray creates a counter's
    series at its first error, so a healthy deployment would otherwise show no data."""
    return f"{rate_by(counter, '', by)} or on ({SERVE_BY}) 0 * {SERVE_HEALTHY}"


SERVE = Row(
    "Serve (Ray Serve's replicas and errors)",
    (
        Panel(
            "Serve replicas per deployment",
            "Healthy replicas of each Serve deployment (engine pools included) and the"
            " number Serve is aiming for (its autoscaler's target, or num_replicas).",
            "short",
            (
                Target(SERVE_HEALTHY, "healthy {{deployment}}"),
                Target(
                    f"max by ({SERVE_BY}) (ray_serve_autoscaling_target_replicas)",
                    "target {{deployment}}",
                ),
            ),
        ),
        Panel(
            "Serve HTTP errors",
            "Responses with a 4xx or 5xx code per second, by deployment and code, as Serve"
            " counted them (503 and 429 include admission control's refusals).",
            "reqps",
            (
                Target(
                    serve_errors(
                        "ray_serve_num_deployment_http_error_requests_total",
                        f"{SERVE_BY}, error_code",
                    ),
                    "{{deployment}} {{error_code}}",
                ),
            ),
        ),
        Panel(
            "Serve replica exceptions",
            "Exceptions raised in each deployment's replicas per second, by type.",
            "short",
            (
                Target(
                    serve_errors(
                        "ray_serve_deployment_error_counter_total", f"{SERVE_BY}, exception_type"
                    ),
                    "{{deployment}} {{exception_type}}",
                ),
            ),
        ),
    ),
)

KV_TRANSFER = Row(
    "KV transfer (PD)",
    (
        Panel(
            "Prefill place",
            "Where each request's prompt was computed (local or remote), and why.",
            "reqps",
            (
                Target(
                    rate_by(c.PREFILL_DECISIONS.total, MODEL, "model, where, reason"),
                    legend("model, where, reason"),
                ),
            ),
        ),
        Panel(
            "KV bytes per second",
            "Bytes put by prefill replicas and read by decode replicas.",
            "Bps",
            (Target(rate_by(c.KV_BYTES.total, "", "op"), legend("op")),),
        ),
        latency(
            "KV put and get time",
            "One put (prefill) or get and write (decode).",
            c.KV_SECONDS.bucket,
            "",
            "op",
        ),
        Panel(
            "Transfers by outcome",
            "loaded, released, expired (TTL) or failed (recomputed), per second; and how "
            "decode ranks got what they loaded: pushed ahead of the request, or claimed.",
            "short",
            (
                Target(rate_by(c.KV_TRANSFERS.total, "", "outcome"), legend("outcome")),
                Target(
                    rate_by(c.KV_LOADS.total, "", "path"),
                    "load {{path}}",
                ),
            ),
        ),
        Panel(
            "KV held in the object store",
            "Bytes of transferred KV not yet freed (TTL or release pending).",
            "bytes",
            (Target(f"sum({c.KV_LIVE_BYTES.name})", "bytes"),),
        ),
    ),
)

QOS = Row(
    "QoS",
    (
        Panel(
            "Rejections by reason and priority",
            "Requests refused by admission control per second (503/429).",
            "reqps",
            (
                Target(
                    rate_by(c.REJECTIONS.total, MODEL, "model, reason, priority"),
                    legend("model, reason, priority"),
                ),
            ),
        ),
        Panel(
            "Requests by priority",
            "Answered requests per second by priority and status.",
            "reqps",
            (
                Target(
                    rate_by(c.REQUESTS.total, MODEL, "priority, status"),
                    legend("priority, status"),
                ),
            ),
        ),
        Panel(
            "Estimated TTFT per replica",
            "Admission control's latest time-to-first-token estimate.",
            "s",
            (
                Target(
                    f"max by (replica) ({c.TTFT_ESTIMATE.name}{{{ROUTER_REPLICA}}})",
                    legend("replica"),
                ),
            ),
        ),
        Panel(
            "Fair shares: requests by API key",
            "Admitted and refused requests per second by API key (its configured name;"
            " anonymous: requests without one), and each key's admitted requests waiting"
            " for a first token, what its weighted share is kept against.",
            "short",
            (
                Target(
                    rate_by(c.KEY_REQUESTS.total, MODEL, "key, outcome"),
                    legend("key, outcome"),
                ),
                Target(
                    f"sum by (key) ({c.KEY_WAITING.name}{{{MODEL}}})",
                    "waiting {{key}}",
                ),
            ),
        ),
        latency(
            "Fair shares: TTFT by API key",
            "Router-side time to first token of streamed requests, per API key.",
            c.KEY_TTFT.bucket,
            MODEL,
            "key",
        ),
    ),
)


def busy_percent(device: str, by: str) -> str:
    """Busy share in percent from the sampler's busy-seconds counter of ``device``."""
    return f"100 * {engine_rate_by(c.BUSY_SECONDS[device].total, REPLICA, by)}"


def sampled(families: dict[str, c.Family]) -> str:
    """The sampler's latest gauge: per GPU where NVML answers, else per engine process."""
    return (
        f"{engine_gauge('max', families['gpu'].name, 'replica, gpu')}"
        f" or {engine_gauge('max', families['cpu'].name, 'replica, process')}"
    )


# GPUs where NVML answers; otherwise the engine processes' CPU (the metric names say which).
UTILIZATION = Row(
    "Utilization (200 ms sampler)",
    (
        Panel(
            "Utilization per GPU (CPU: per engine process)",
            "Mean of every 200 ms sample in the window (from the busy-seconds counters):"
            " per GPU where NVML answers, else per engine process (100% = one core).",
            "percent",
            (
                Target(
                    f"{busy_percent('gpu', 'replica, gpu')}"
                    f" or {busy_percent('cpu', 'replica, process')}",
                    "{{replica}} {{gpu}}{{process}}",
                ),
            ),
        ),
        Panel(
            "Utilization imbalance (max - min)",
            "Between GPUs, as the study reports; on CPU between replicas (all processes"
            " of a replica summed).",
            "percent",
            (
                Target(
                    f"(max({busy_percent('gpu', 'replica, gpu')})"
                    f" - min({busy_percent('gpu', 'replica, gpu')}))"
                    f" or (max({busy_percent('cpu', 'replica')})"
                    f" - min({busy_percent('cpu', 'replica')}))",
                    "max - min",
                ),
            ),
        ),
        Panel(
            "Latest sample",
            "The sampler's gauges: the latest 200 ms sample each time Ray exports.",
            "percent",
            (Target(sampled(c.UTILIZATION), "{{replica}} {{gpu}}{{process}}"),),
        ),
        Panel(
            "Memory used",
            "GPU memory in use per GPU; on CPU the resident memory of each engine process.",
            "bytes",
            (Target(sampled(c.MEMORY_USED), "{{replica}} {{gpu}}{{process}}"),),
        ),
        Panel(
            "Sampler ticks per second",
            "Should stay at 5 (one sample per 200 ms); source says nvml or cpu.",
            "short",
            (
                Target(
                    engine_rate_by(c.UTILIZATION_SAMPLES.total, REPLICA, "replica, source"),
                    legend("replica, source"),
                ),
            ),
        ),
    ),
)

ROWS = (CLIENT, ROUTER, ENGINES, SERVE, KV_TRANSFER, QOS, UTILIZATION)
# Where Grafana's replica dropdown finds engine replicas: vLLM's gauge, under either name.
REPLICA_VALUES = (
    f'{{__name__=~"vllm:num_requests_running|{ray_exported("vllm:num_requests_running")}"}}'
)

TEMPLATE_VARIABLES = ("run", "model", "shape", "replica")


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "refresh": 2,  # on time range change: new runs and replicas appear
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def templating() -> dict[str, Any]:
    return {
        "list": [
            {
                "name": "datasource",
                "label": "Prometheus",
                "type": "datasource",
                "query": "prometheus",
                "current": {},
                "refresh": 1,
            },
            _variable(
                "run", "load generator run", f"label_values({c.LOADGEN_REQUESTS.total}, run)"
            ),
            _variable("model", "served model", f"label_values({c.TOKENS.total}, model)"),
            # A histogram has no series under its bare name: its _count has them all.
            _variable(
                "shape",
                "router shape",
                f"label_values({c.E2E.count}, shape)",
            ),
            _variable("replica", "engine replica", f"label_values({REPLICA_VALUES}, replica)"),
        ]
    }


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": PANEL_WIDTH, "h": PANEL_HEIGHT},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "refId": chr(ord("A") + index),
                "datasource": DATASOURCE,
                "expr": target.expr,
                "legendFormat": target.legend,
            }
            for index, target in enumerate(panel.targets)
        ],
    }


def build_dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    next_id, y = 1, 0
    for row in ROWS:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"x": 0, "y": y, "w": GRID_WIDTH, "h": 1},
                "panels": [],
            }
        )
        next_id, y = next_id + 1, y + 1
        for index, panel in enumerate(row.panels):
            x = (index * PANEL_WIDTH) % GRID_WIDTH
            if index and x == 0:
                y += PANEL_HEIGHT
            panels.append(_panel_json(panel, next_id, x, y))
            next_id += 1
        y += PANEL_HEIGHT
    return {
        "uid": DASHBOARD_UID,
        "title": "splitserve",
        "description": "Client, router, engines, KV transfer, QoS and utilization of a"
        " splitserve deployment (see dashboards/prometheus.yml for what is scraped).",
        "tags": ["splitserve", "vllm", "ray-serve"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "templating": templating(),
        "annotations": {"list": []},
        "panels": panels,
    }


# PromQL words that look like metric names to a tokenizer.
PROMQL_WORDS = frozenset(
    {"sum", "max", "min", "avg", "rate", "increase", "histogram_quantile", "or", "and"}
)
_NOT_NAMES = re.compile(r'\{[^}]*\}|\[[^\]]*\]|"[^"]*"|\b(?:by|without|on|ignoring)\s*\([^)]*\)')
_IDENTIFIER = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names one PromQL expression reads (labels, windows, functions removed)."""
    return {name for name in _IDENTIFIER.findall(_NOT_NAMES.sub(" ", expr))} - PROMQL_WORDS


def expand(expr: str, rate_window: str, values: dict[str, str] | None = None) -> str:
    """An expression as Grafana would send it: variables substituted (default: All)."""
    values = values or {}
    expr = expr.replace("$__rate_interval", rate_window)
    for variable in TEMPLATE_VARIABLES:
        expr = expr.replace(f"${variable}", values.get(variable, ".*"))
    return expr


def expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every query target in the dashboard."""
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def render() -> str:
    return json.dumps(build_dashboard(), indent=2) + "\n"


def main() -> int:
    DASHBOARD_PATH.write_text(render())
    print(f"wrote {DASHBOARD_PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
