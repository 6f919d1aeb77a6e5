"""Every metric family and HTTP header splitserve defines, in one place.

The router's registry, the KV directory's collector, the engines' utilization sampler,
the load generator (its own exposition, its reading of a server's ``/metrics``, its fake
server) and the dashboards all take their names, labels, help and buckets from here, so
they cannot drift apart. tests/dashboards checks that every name a panel or an alert
queries is here, and that each registry exposes exactly the families listed for it.
vLLM's and Ray Serve's own families are theirs (tests/dashboards/names.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

Kind = Literal["counter", "gauge", "histogram"]
# The series Prometheus stores for one family of each kind.
SUFFIXES: dict[Kind, tuple[str, ...]] = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
}


@dataclass(frozen=True)
class Family:
    """One metric family: its name as registered (a counter's without ``_total``)."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def total(self) -> str:
        """A counter's series name."""
        return self.name + "_total"

    @property
    def bucket(self) -> str:
        return self.name + "_bucket"

    @property
    def count(self) -> str:
        return self.name + "_count"

    @property
    def sum(self) -> str:
        return self.name + "_sum"

    def series(self) -> frozenset[str]:
        return frozenset(self.name + suffix for suffix in SUFFIXES[self.kind])


def register(family: Family, registry: CollectorRegistry) -> Any:
    """A prometheus-client family as the catalogue defines it, in ``registry``."""
    if family.kind == "histogram":
        return Histogram(
            family.name, family.help, family.labels, buckets=family.buckets, registry=registry
        )
    kind = Counter if family.kind == "counter" else Gauge
    return kind(family.name, family.help, family.labels, registry=registry)


def series_of(families: tuple[Family, ...]) -> frozenset[str]:
    return frozenset().union(*(family.series() for family in families))


# ---- labels ---------------------------------------------------------------------------
MODEL = "model"  # the served model's name, on every router family but the keys'
SHAPE = "shape"  # single, tp, pp, dp, pd, auto (docs/ARCHITECTURE.md's glossary)
REPLICA = "replica"  # an engine's name (prefill-0)
ROLE = "role"  # prefill, decode, mixed
# Each series of the load generator: one cell of a sweep.
RUN_LABELS = ("run", SHAPE, "workload", "qps")

# ---- buckets --------------------------------------------------------------------------
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
# Zero (the signal was right), then whole blocks (16 tokens on GPUs, 128 on vLLM's CPU
# backend) up to a long prompt.
PREFIX_ERROR_BUCKETS = (0.5, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# One part of a 2k-token prompt is tens of MiB; puts and gets take 1 ms to 1 s.
KV_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# The client sees from half a millisecond (a gap between tokens) to two minutes (a
# request queued behind an overloaded server).
CLIENT_LATENCY_BUCKETS_S = (0.0005, *LATENCY_BUCKETS_S, 120.0)

# ---- the router (router/observation/metrics.py) ---------------------------------------
REQUESTS = Family(
    "splitserve_requests",
    "counter",
    "HTTP requests answered by the router, by route, status code and priority.",
    (MODEL, "route", "status", "priority"),
)
REJECTIONS = Family(
    "splitserve_rejections",
    "counter",
    "Requests refused by admission control, by reason and priority.",
    (MODEL, "reason", "priority"),
)
PRIORITY_CAPPED = Family(
    "splitserve_priority_capped",
    "counter",
    "Requests served at a lower priority than they asked for, because their API key allows"
    " no higher: by the key's configured name (never the key), the priority requested and"
    " the one granted.",
    ("key", "requested", "granted"),
)
KEY_REQUESTS = Family(
    "splitserve_key_requests",
    "counter",
    "Requests admission decided on, by API key (its configured name, never the key;"
    " 'anonymous' for requests without one), priority and outcome (admitted or refused).",
    (MODEL, "key", "priority", "outcome"),
)
KEY_WAITING = Family(
    "splitserve_key_waiting_requests",
    "gauge",
    "Admitted requests waiting for their first token, by API key (its name) and priority:"
    " what the key's fair share is weighed against.",
    (MODEL, "key", "priority"),
)
KEY_TTFT = Family(
    "splitserve_key_time_to_first_token_seconds",
    "histogram",
    "Router-side time from request arrival to the first token, streamed requests, by API"
    " key (its name).",
    (MODEL, "key"),
    LATENCY_BUCKETS_S,
)
QUEUE = Family(
    "splitserve_queue_seconds",
    "histogram",
    "Router-side time from request arrival until an engine accepted it.",
    (MODEL, SHAPE),
    LATENCY_BUCKETS_S,
)
REPLICA_CHOICES = Family(
    "splitserve_replica_choices",
    "counter",
    "Replica choices per pool, by policy, chosen replica and why.",
    (MODEL, "pool", "policy", REPLICA, "reason"),
)
TTFT_ESTIMATE = Family(
    "splitserve_ttft_estimate_seconds",
    "gauge",
    "The latest time-to-first-token estimate admission control made, per replica that would"
    " compute the prompt.",
    (MODEL, REPLICA),
)
PREFILL_SECONDS_PER_TOKEN = Family(
    "splitserve_prefill_seconds_per_token",
    "gauge",
    "The router's moving average of seconds of time to first token per prefill token queued"
    " or computed, per replica (seeded by the calibration prefill).",
    (MODEL, REPLICA),
)
DECODE_STEP_SECONDS = Family(
    "splitserve_decode_step_seconds",
    "gauge",
    "The router's moving average of seconds between tokens, per replica.",
    (MODEL, REPLICA),
)
PREFIX_CACHE_TOKENS = Family(
    "splitserve_prefix_cache_tokens",
    "counter",
    "Prompt tokens found in a replica's prefix cache: as the router estimated before routing"
    " (estimated: the signal it routed by; kv_events, mirror: each signal), and as vLLM"
    " reported for the same requests (reported).",
    (MODEL, REPLICA, "source"),
)
PREFIX_ESTIMATE_ERROR = Family(
    "splitserve_prefix_estimate_error_tokens",
    "histogram",
    "Per request, how far each prefix signal's cached-token count was from what vLLM found"
    " (absolute, tokens).",
    (MODEL, "signal"),
    PREFIX_ERROR_BUCKETS,
)
REPLICA_REQUESTS = Family(
    "splitserve_replica_requests",
    "counter",
    "Generation requests sent to each engine replica.",
    (MODEL, REPLICA, ROLE),
)
REPLICA_IN_FLIGHT = Family(
    "splitserve_replica_in_flight_requests",
    "gauge",
    "Requests the router has in flight on each engine replica.",
    (MODEL, REPLICA, ROLE),
)
TTFT = Family(
    "splitserve_time_to_first_token_seconds",
    "histogram",
    "Router-side time from request arrival to the first token, streamed requests.",
    (MODEL, SHAPE, "prefill"),
    LATENCY_BUCKETS_S,
)
ITL = Family(
    "splitserve_inter_token_latency_seconds",
    "histogram",
    "Router-side time between consecutive streamed tokens.",
    (MODEL, SHAPE),
    ITL_BUCKETS_S,
)
E2E = Family(
    "splitserve_e2e_request_latency_seconds",
    "histogram",
    "Router-side time from request arrival to the last token.",
    (MODEL, SHAPE),
    LATENCY_BUCKETS_S,
)
PREFILL_DECISIONS = Family(
    "splitserve_prefill_decisions",
    "counter",
    "Where each request's prompt was computed (local or remote) and why.",
    (MODEL, "where", "reason"),
)
ENGINE_REQUESTS = Family(
    "splitserve_engine_requests",
    "gauge",
    "Requests in each engine replica by state, as the engine last reported.",
    (MODEL, REPLICA, ROLE, "state"),
)
ENGINE_KV_CACHE_USAGE = Family(
    "splitserve_engine_kv_cache_usage_ratio",
    "gauge",
    "Share of each engine replica's KV cache in use (0 to 1).",
    (MODEL, REPLICA, ROLE),
)
ENGINE_PROMPT_TOKENS = Family(
    "splitserve_engine_prompt_tokens",
    "gauge",
    "Prompt tokens each engine replica has processed since it started, by where their KV"
    " came from (vLLM's sources: local_compute, local_cache_hit, external_kv_transfer), as"
    " the engine last reported; a counter inside the engine.",
    (MODEL, REPLICA, ROLE, "source"),
)
ENGINE_STATS_AGE = Family(
    "splitserve_engine_stats_age_seconds",
    "gauge",
    "Age of the last scheduler report of each engine replica when polled.",
    (MODEL, REPLICA, ROLE),
)
TRAFFIC_DRIFT = Family(
    "splitserve_traffic_drift_ratio",
    "gauge",
    "Live traffic (the last router.traffic_profile.window_requests answered requests) over"
    " the traffic profile the shape was chosen for, by quantity (prompt_tokens,"
    " output_tokens, request_rate); 1 is as profiled.",
    (MODEL, "quantity"),
)
TRAFFIC_DRIFTED = Family(
    "splitserve_traffic_drifted",
    "gauge",
    "1 while the quantity's drift ratio is outside router.traffic_profile.tolerance.",
    (MODEL, "quantity"),
)
TOKENS = Family(
    "splitserve_tokens",
    "counter",
    "Tokens processed, by kind (prompt or generation).",
    (MODEL, "kind"),
)
ROUTER_FAMILIES = (
    REQUESTS,
    REJECTIONS,
    PRIORITY_CAPPED,
    KEY_REQUESTS,
    KEY_WAITING,
    KEY_TTFT,
    QUEUE,
    REPLICA_CHOICES,
    TTFT_ESTIMATE,
    PREFILL_SECONDS_PER_TOKEN,
    DECODE_STEP_SECONDS,
    PREFIX_CACHE_TOKENS,
    PREFIX_ESTIMATE_ERROR,
    REPLICA_REQUESTS,
    REPLICA_IN_FLIGHT,
    TTFT,
    ITL,
    E2E,
    PREFILL_DECISIONS,
    ENGINE_REQUESTS,
    ENGINE_KV_CACHE_USAGE,
    ENGINE_PROMPT_TOKENS,
    ENGINE_STATS_AGE,
    TRAFFIC_DRIFT,
    TRAFFIC_DRIFTED,
    TOKENS,
)

# ---- KV hand-overs: the engines' transfer statistics and the directory's ledger -------
# (kv_transfer/metrics.py)
KV_BYTES = Family(
    "splitserve_kv_transfer_bytes", "counter", "KV bytes moved through Ray's object store", ("op",)
)
KV_SECONDS = Family(
    "splitserve_kv_transfer_seconds",
    "histogram",
    "Time of one KV put (prefill) or get+write (decode)",
    ("op",),
    KV_SECONDS_BUCKETS,
)
KV_HANDOVERS = Family(
    "splitserve_kv_transfer_handovers",
    "counter",
    "KV hand-overs put (prefill) or loaded (decode), one per request whatever its ranks",
    ("op",),
)
KV_TRANSFERS = Family(
    "splitserve_kv_transfers", "counter", "KV transfers by how they ended", ("outcome",)
)
KV_LOADS = Family(
    "splitserve_kv_transfer_loads",
    "counter",
    "KV parts loaded by decode ranks, by how they got them",
    ("path",),
)
KV_LIVE_TRANSFERS = Family(
    "splitserve_kv_transfer_live_transfers", "gauge", "KV transfers held in the object store"
)
KV_LIVE_BYTES = Family(
    "splitserve_kv_transfer_live_bytes", "gauge", "Bytes of KV held in the object store"
)
KV_FAMILIES = (
    KV_BYTES,
    KV_SECONDS,
    KV_HANDOVERS,
    KV_TRANSFERS,
    KV_LOADS,
    KV_LIVE_TRANSFERS,
    KV_LIVE_BYTES,
)

# ---- each engine's utilization (engines/sampler.py, through Ray's metrics) --------------
ENGINE_LABELS = (REPLICA, ROLE)
# The device label of each source: a GPU's index, or the engine's process.
DEVICE_LABEL = {"gpu": "gpu", "cpu": "process"}
UTILIZATION = {
    "gpu": Family(
        "splitserve_gpu_utilization_percent",
        "gauge",
        "GPU utilization (NVML), percent, latest 200 ms sample, per GPU of the replica.",
        (*ENGINE_LABELS, "gpu"),
    ),
    "cpu": Family(
        "splitserve_cpu_utilization_percent",
        "gauge",
        "CPU use of the replica's engine processes, percent of one core, latest sample"
        " (exported where no GPU or NVML is available).",
        (*ENGINE_LABELS, "process"),
    ),
}
MEMORY_USED = {
    "gpu": Family(
        "splitserve_gpu_memory_used_bytes",
        "gauge",
        "GPU memory in use (NVML), bytes, per GPU of the replica.",
        (*ENGINE_LABELS, "gpu"),
    ),
    "cpu": Family(
        "splitserve_cpu_memory_used_bytes",
        "gauge",
        "Resident memory of the replica's engine processes, bytes.",
        (*ENGINE_LABELS, "process"),
    ),
}
BUSY_SECONDS = {
    "gpu": Family(
        "splitserve_gpu_busy_seconds",
        "counter",
        "Sum of GPU utilization x sample period, seconds: rate() is mean utilization.",
        (*ENGINE_LABELS, "gpu"),
    ),
    "cpu": Family(
        "splitserve_cpu_busy_seconds",
        "counter",
        "CPU seconds of the replica's engine processes: rate() is cores in use.",
        (*ENGINE_LABELS, "process"),
    ),
}
UTILIZATION_SAMPLES = Family(
    "splitserve_utilization_samples",
    "counter",
    "Utilization sampler ticks per replica; source says what was read (nvml or cpu).",
    (*ENGINE_LABELS, "source"),
)
SAMPLER_FAMILIES = (
    *UTILIZATION.values(),
    *MEMORY_USED.values(),
    *BUSY_SECONDS.values(),
    UTILIZATION_SAMPLES,
)

# ---- the load generator's own (loadgen/outputs/exposition.py) ---------------------------------
LOADGEN_TTFT = Family(
    "loadgen_time_to_first_token_seconds",
    "histogram",
    "Client-side time to the first token.",
    RUN_LABELS,
    CLIENT_LATENCY_BUCKETS_S,
)
LOADGEN_ITL = Family(
    "loadgen_inter_token_latency_seconds",
    "histogram",
    "Client-side gaps between consecutive tokens.",
    RUN_LABELS,
    CLIENT_LATENCY_BUCKETS_S,
)
LOADGEN_TPOT = Family(
    "loadgen_time_per_output_token_seconds",
    "histogram",
    "Per request: (last - first token) / (n - 1).",
    RUN_LABELS,
    CLIENT_LATENCY_BUCKETS_S,
)
LOADGEN_E2E = Family(
    "loadgen_e2e_request_latency_seconds",
    "histogram",
    "Client-side time to the end of the stream.",
    RUN_LABELS,
    CLIENT_LATENCY_BUCKETS_S,
)
LOADGEN_SEND_LAG = Family(
    "loadgen_send_lag_seconds",
    "histogram",
    "Actual minus scheduled send time.",
    RUN_LABELS,
    CLIENT_LATENCY_BUCKETS_S,
)
LOADGEN_REQUESTS = Family(
    "loadgen_requests",
    "counter",
    "Finished requests by outcome (ok, rejected, error) and status.",
    (*RUN_LABELS, "outcome", "status"),
)
LOADGEN_TOKENS = Family(
    "loadgen_tokens", "counter", "Tokens of completed requests.", (*RUN_LABELS, "kind")
)
LOADGEN_IN_FLIGHT = Family(
    "loadgen_in_flight_requests", "gauge", "Requests sent, not done.", RUN_LABELS
)
LOADGEN_SENT = Family(
    "loadgen_sent_requests", "gauge", "Requests sent so far in the run.", RUN_LABELS
)
LOADGEN_TARGET_QPS = Family("loadgen_target_qps", "gauge", "The run's request rate.", RUN_LABELS)
LOADGEN_LIVE_TTFT_P50 = Family(
    "loadgen_live_ttft_p50_seconds",
    "gauge",
    "Median TTFT of the most recent completed requests.",
    RUN_LABELS,
)
LOADGEN_FAMILIES = (
    LOADGEN_TTFT,
    LOADGEN_ITL,
    LOADGEN_TPOT,
    LOADGEN_E2E,
    LOADGEN_SEND_LAG,
    LOADGEN_REQUESTS,
    LOADGEN_TOKENS,
    LOADGEN_IN_FLIGHT,
    LOADGEN_SENT,
    LOADGEN_TARGET_QPS,
    LOADGEN_LIVE_TTFT_P50,
)

ALL_FAMILIES = ROUTER_FAMILIES + KV_FAMILIES + SAMPLER_FAMILIES + LOADGEN_FAMILIES

# ---- headers --------------------------------------------------------------------------
# Answered by the router: the engine that generated, and for PD and auto the prefill
# decision (``where:reason``) and the engine that computed a remote prompt.
REPLICA_HEADER = "x-splitserve-replica"
PREFILL_HEADER = "x-splitserve-prefill"
PREFILL_REPLICA_HEADER = "x-splitserve-prefill-replica"
# Read by the router: a request's priority (where the body has none), its id.
PRIORITY_HEADER = "x-priority"
REQUEST_ID_HEADER = "x-request-id"
