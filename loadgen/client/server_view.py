"""The server's side of a run, from its Prometheus metrics, for the report.

Before and after each run the router's ``/metrics`` is scraped (counters: requests by
status, rejections, local/remote prefill decisions), and during the run it is
sampled every ``--server-sample-interval`` for gauges (GPU utilization per GPU, KV
cache usage, engine queues). Samples are stored as text while the run is sending
and parsed afterwards, so scraping never delays a send. With ``--prometheus-url``
the GPU utilization and KV cache figures come from Prometheus' own samples over the
run's window instead.

Utilization is reported as the study does: the mean per GPU, their mean, and the
imbalance max - min between GPUs. Metrics a server does not export are left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from splitserve import metric_catalogue as catalogue

logger = logging.getLogger("loadgen.client.server_view")

Samples = dict[str, list[tuple[dict[str, str], float]]]
GPU_UTILIZATION = catalogue.UTILIZATION["gpu"].name
UTILIZATION_SUFFIX = "_utilization_percent"  # every device's (catalogue.UTILIZATION)
KV_CACHE_USAGE = catalogue.ENGINE_KV_CACHE_USAGE.name
ENGINE_REQUESTS = catalogue.ENGINE_REQUESTS.name
PREFILL_DECISIONS = catalogue.PREFILL_DECISIONS.total
REJECTIONS = catalogue.REJECTIONS.total
SERVER_REQUESTS = catalogue.REQUESTS.total
PREFILL_S_PER_TOKEN = catalogue.PREFILL_SECONDS_PER_TOKEN.name
DECODE_STEP_S = catalogue.DECODE_STEP_SECONDS.name
KV_SECONDS_SUM = catalogue.KV_SECONDS.sum
KV_BYTES = catalogue.KV_BYTES.total
KV_HANDOVERS = catalogue.KV_HANDOVERS.total
MIB = 2**20
SCRAPE_TIMEOUT_S = 5.0


def parse_metrics(text: str) -> Samples:
    """Prometheus text → sample name → [(labels, value)]."""
    samples: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append((dict(sample.labels), float(sample.value)))
    return dict(samples)


def _sum_by(samples: Samples, name: str, label: str | None) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for labels, value in samples.get(name, []):
        totals[labels.get(label, "") if label else ""] += value
    return dict(totals)


def _delta(before: Samples, after: Samples, name: str, label: str | None) -> dict[str, float]:
    start, end = _sum_by(before, name, label), _sum_by(after, name, label)
    # A counter that went down means the server restarted: count from zero.
    return {
        key: value - start.get(key, 0.0) if value >= start.get(key, 0.0) else value
        for key, value in end.items()
    }


@dataclass
class ServerView:
    """What the server reported about one run; None where it exports nothing."""

    source: str = "none"
    samples: int = 0
    gpu_utilization_pct: dict[str, float] = field(default_factory=dict)
    gpu_utilization_mean_pct: float | None = None
    gpu_imbalance_pct: float | None = None
    other_utilization_pct: dict[str, dict[str, float]] = field(default_factory=dict)
    kv_cache_usage_mean: dict[str, float] = field(default_factory=dict)
    kv_cache_usage_max: dict[str, float] = field(default_factory=dict)
    engine_waiting_max: float | None = None
    engine_running_max: float | None = None
    prefill_local: float | None = None
    prefill_remote: float | None = None
    rejections: float | None = None
    requests_by_status: dict[str, float] = field(default_factory=dict)
    # The router's own estimates, per replica, at the end of the run: seconds of TTFT
    # per prefill token and seconds per decode step (the shape advisor's inputs).
    prefill_s_per_token: dict[str, float] = field(default_factory=dict)
    decode_step_s: dict[str, float] = field(default_factory=dict)
    # PD: seconds of put + get per MiB of KV loaded, and per transfer loaded, in the run.
    kv_transfer_s_per_mib: float | None = None
    kv_transfer_s_per_request: float | None = None
    notes: list[str] = field(default_factory=list)

    def set_gpu_utilization(self, per_gpu: dict[str, float]) -> None:
        self.gpu_utilization_pct = dict(sorted(per_gpu.items()))
        values = list(per_gpu.values())
        if values:
            self.gpu_utilization_mean_pct = sum(values) / len(values)
            self.gpu_imbalance_pct = max(values) - min(values)


def build_view(before: Samples | None, during: list[Samples], after: Samples | None) -> ServerView:
    """Counters from before/after, gauges averaged over every sample of the run."""
    if after is None:
        return ServerView(notes=["the server's /metrics could not be scraped"])
    view = ServerView(source="router /metrics", samples=len(during))
    gauges = [*during, after] if during else [after]
    view.set_gpu_utilization(_gauge_means(gauges, GPU_UTILIZATION, "gpu"))
    view.other_utilization_pct = {
        name: _gauge_means(gauges, name, None)
        for name in sorted({n for s in gauges for n in s if n.endswith(UTILIZATION_SUFFIX)})
        if name != GPU_UTILIZATION
    }
    view.kv_cache_usage_mean = _gauge_means(gauges, KV_CACHE_USAGE, "replica")
    view.kv_cache_usage_max = _gauge_max(gauges, KV_CACHE_USAGE, "replica")
    view.engine_waiting_max = _state_max(gauges, "waiting")
    view.engine_running_max = _state_max(gauges, "running")
    before = before or {}
    if PREFILL_DECISIONS in after:
        decisions = _delta(before, after, PREFILL_DECISIONS, "where")
        view.prefill_local = decisions.get("local", 0.0)
        view.prefill_remote = decisions.get("remote", 0.0)
    if REJECTIONS in after:
        view.rejections = sum(_delta(before, after, REJECTIONS, None).values())
    view.requests_by_status = {
        status: count
        for status, count in _delta(before, after, SERVER_REQUESTS, "status").items()
        if count
    }
    view.prefill_s_per_token = _sum_by(after, PREFILL_S_PER_TOKEN, "replica")
    view.decode_step_s = _sum_by(after, DECODE_STEP_S, "replica")
    if KV_SECONDS_SUM in after and KV_BYTES in after:
        seconds = sum(_delta(before, after, KV_SECONDS_SUM, None).values())
        loaded = _delta(before, after, KV_BYTES, "op").get("get", 0.0)
        if loaded > 0:
            view.kv_transfer_s_per_mib = seconds / (loaded / MIB)
        transfers = _delta(before, after, KV_HANDOVERS, "op").get("get", 0.0)
        if transfers > 0:
            view.kv_transfer_s_per_request = seconds / transfers
    return view


def _gauge_means(snapshots: list[Samples], name: str, label: str | None) -> dict[str, float]:
    values: dict[str, list[float]] = defaultdict(list)
    for samples in snapshots:
        for labels, value in samples.get(name, []):
            values[_label_key(labels, label)].append(value)
    return {key: sum(v) / len(v) for key, v in values.items()}


def _gauge_max(snapshots: list[Samples], name: str, label: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for samples in snapshots:
        for labels, value in samples.get(name, []):
            key = labels.get(label, "")
            values[key] = max(values.get(key, -math.inf), value)
    return values


def _state_max(snapshots: list[Samples], state: str) -> float | None:
    totals = [
        sum(v for labels, v in samples.get(ENGINE_REQUESTS, []) if labels.get("state") == state)
        for samples in snapshots
        if ENGINE_REQUESTS in samples
    ]
    return max(totals) if totals else None


def _label_key(labels: dict[str, str], label: str | None) -> str:
    if label:
        return labels.get(label, "")
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "value"


def discover_shape(samples: Samples | None, model: str | None = None) -> str | None:
    """The router's shape label (``shape``) on its own histograms, if it has served any:
    of ``model``'s series where it has some (a router of several models serves each in
    a shape of its own), else of them all."""
    if not samples:
        return None
    shaped = [
        labels
        for name, series in samples.items()
        if name.startswith("splitserve_")
        for labels, _ in series
        if labels.get(catalogue.SHAPE)
    ]
    own = [
        labels for labels in shaped if model is not None and labels.get(catalogue.MODEL) == model
    ]
    shapes = Counter(labels[catalogue.SHAPE] for labels in own or shaped)
    return shapes.most_common(1)[0][0] if shapes else None


class ServerViewRecorder:
    """Scrapes ``/metrics`` around and during a run; parses only once it is over."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        metrics_url: str,
        interval_s: float,
        prometheus_url: str | None = None,
    ) -> None:
        self._http = http
        self._url = metrics_url
        self._interval_s = interval_s
        self._prometheus_url = prometheus_url
        self._before: str | None = None
        self._after: str | None = None
        self._during: list[str] = []
        self._sampler: asyncio.Task[None] | None = None
        self._window: tuple[float, float] = (0.0, 0.0)

    async def scrape_text(self) -> str | None:
        try:
            response = await self._http.get(self._url, timeout=SCRAPE_TIMEOUT_S)
        except httpx.HTTPError as error:
            logger.debug("scraping %s failed: %s", self._url, error)
            return None
        return response.text if response.status_code == 200 else None

    async def start(self) -> None:
        self._before = await self.scrape_text()
        self._window = (time.time(), 0.0)
        self._sampler = asyncio.create_task(self._sample())

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        self._window = (self._window[0], time.time())
        self._after = await self.scrape_text()

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            if (text := await self.scrape_text()) is not None:
                self._during.append(text)

    async def view(self) -> ServerView:
        view = build_view(
            _parse_or_none(self._before),
            [s for text in self._during if (s := _parse_or_none(text)) is not None],
            _parse_or_none(self._after),
        )
        if self._prometheus_url:
            await self._add_prometheus(view)
        return view

    async def _add_prometheus(self, view: ServerView) -> None:
        start, end = self._window
        window = f"{max(1, math.ceil(end - start))}s"
        try:
            gpu = await self._query(f"avg_over_time({GPU_UTILIZATION}[{window}])", end, "gpu")
            kv_mean = await self._query(
                f"avg_over_time({KV_CACHE_USAGE}[{window}])", end, "replica"
            )
            kv_max = await self._query(f"max_over_time({KV_CACHE_USAGE}[{window}])", end, "replica")
        except (httpx.HTTPError, ValueError, KeyError) as error:
            view.notes.append(f"Prometheus at {self._prometheus_url} failed: {error}")
            return
        view.source += " + Prometheus"
        if gpu:
            view.set_gpu_utilization(gpu)
        view.kv_cache_usage_mean = kv_mean or view.kv_cache_usage_mean
        view.kv_cache_usage_max = kv_max or view.kv_cache_usage_max

    async def _query(self, query: str, at: float, label: str) -> dict[str, float]:
        response = await self._http.get(
            f"{self._prometheus_url.rstrip('/')}/api/v1/query",  # type: ignore[union-attr]
            params={"query": query, "time": f"{at:.3f}"},
            timeout=SCRAPE_TIMEOUT_S,
        )
        response.raise_for_status()
        result = response.json()["data"]["result"]
        return {item["metric"].get(label, ""): float(item["value"][1]) for item in result}


def _parse_or_none(text: str | None) -> Samples | None:
    if text is None:
        return None
    try:
        return parse_metrics(text)
    except ValueError as error:
        logger.warning("unparseable /metrics page: %s", error)
        return None
