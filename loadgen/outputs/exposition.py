"""The load generator's own live figures as Prometheus metrics on ``--metrics-port``.

Every series carries the labels ``run, shape, workload, qps`` so one dashboard can
follow a sweep cell by cell. Latency histograms are batched: a finished request
appends its samples to a list, and the buckets are counted with numpy when
Prometheus scrapes. An ITL histogram then costs nothing per token while the run is
sending, which matters at thousands of tokens per second.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from loadgen.outputs.stats import RequestMetrics
from splitserve import metric_catalogue as catalogue
from splitserve.metric_catalogue import Family

LabelValues = tuple[str, ...]


class BatchedHistogram(Collector):
    """A labelled histogram fed in batches and bucketed only when collected."""

    def __init__(self, family: Family) -> None:
        self._name = family.name
        self._documentation = family.help
        self._labels = family.labels
        self._edges = np.asarray(family.buckets, dtype=float)
        self._lock = threading.Lock()
        self._pending: dict[LabelValues, list[float]] = defaultdict(list)
        self._counts: dict[LabelValues, np.ndarray] = {}
        self._sums: dict[LabelValues, float] = defaultdict(float)

    def observe_many(self, labels: LabelValues, values: Iterable[float]) -> None:
        with self._lock:
            self._pending[labels].extend(values)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            pending, self._pending = self._pending, defaultdict(list)
            for labels, values in pending.items():
                self._add(labels, np.asarray(values, dtype=float))
            snapshot = {labels: counts.copy() for labels, counts in self._counts.items()}
            sums = dict(self._sums)
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labels)
        for labels, counts in snapshot.items():
            cumulative = np.cumsum(counts)
            bounds = [*(f"{edge:g}" for edge in self._edges), "+Inf"]
            family.add_metric(
                list(labels),
                list(zip(bounds, cumulative.tolist(), strict=True)),
                sums[labels],
            )
        yield family

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self._name, self._documentation, labels=self._labels)

    def _add(self, labels: LabelValues, values: np.ndarray) -> None:
        counts = self._counts.setdefault(labels, np.zeros(len(self._edges) + 1, dtype=np.int64))
        # Bucket i counts values <= edge i (Prometheus' "le"), the last one +Inf.
        counts += np.bincount(
            np.searchsorted(self._edges, values, side="left"), minlength=len(counts)
        )
        self._sums[labels] += float(values.sum())


def _described(family: Family) -> tuple[str, str, tuple[str, ...]]:
    return family.name, family.help, family.labels


class Exposition:
    """One registry for the process; each run gets its own label set."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = BatchedHistogram(catalogue.LOADGEN_TTFT)
        self.itl = BatchedHistogram(catalogue.LOADGEN_ITL)
        self.tpot = BatchedHistogram(catalogue.LOADGEN_TPOT)
        self.e2e = BatchedHistogram(catalogue.LOADGEN_E2E)
        self.send_lag = BatchedHistogram(catalogue.LOADGEN_SEND_LAG)
        for histogram in (self.ttft, self.itl, self.tpot, self.e2e, self.send_lag):
            r.register(histogram)
        self.requests = Counter(*_described(catalogue.LOADGEN_REQUESTS), registry=r)
        self.tokens = Counter(*_described(catalogue.LOADGEN_TOKENS), registry=r)
        self.in_flight = Gauge(*_described(catalogue.LOADGEN_IN_FLIGHT), registry=r)
        self.sent = Gauge(*_described(catalogue.LOADGEN_SENT), registry=r)
        self.target_qps = Gauge(*_described(catalogue.LOADGEN_TARGET_QPS), registry=r)
        self.live_ttft_p50 = Gauge(*_described(catalogue.LOADGEN_LIVE_TTFT_P50), registry=r)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Expose ``/metrics`` on ``host:port`` from a background thread."""
        start_http_server(port, addr=host, registry=self.registry)

    def for_run(self, run: str, shape: str, workload: str, qps: float) -> RunMetrics:
        qps_label = "inf" if math.isinf(qps) else f"{qps:g}"
        metrics = RunMetrics(self, (run, shape, workload, qps_label))
        self.target_qps.labels(*metrics.labels).set(qps)
        return metrics


class RunMetrics:
    """The exposition's series of one run."""

    def __init__(self, exposition: Exposition, labels: LabelValues) -> None:
        self.labels = labels
        self._exposition = exposition
        self._sent = exposition.sent.labels(*labels)
        self._in_flight = exposition.in_flight.labels(*labels)
        self._input_tokens = exposition.tokens.labels(*labels, "input")
        self._output_tokens = exposition.tokens.labels(*labels, "output")
        self._live_ttft = exposition.live_ttft_p50.labels(*labels)

    def request_sent(self, sent: int, in_flight: int) -> None:
        self._sent.set(sent)
        self._in_flight.set(in_flight)

    def request_done(self, metrics: RequestMetrics, in_flight: int) -> None:
        e = self._exposition
        e.requests.labels(*self.labels, metrics.outcome, metrics.status).inc()
        self._in_flight.set(in_flight)
        if math.isfinite(metrics.send_lag_s):
            e.send_lag.observe_many(self.labels, (metrics.send_lag_s,))
        if metrics.outcome != "ok":
            return
        self._input_tokens.inc(metrics.input_tokens)
        self._output_tokens.inc(metrics.output_tokens)
        e.ttft.observe_many(self.labels, (metrics.ttft_s,))  # type: ignore[arg-type]
        e.e2e.observe_many(self.labels, (metrics.e2e_s,))  # type: ignore[arg-type]
        e.itl.observe_many(self.labels, metrics.itl_s)
        if metrics.tpot_s is not None:
            e.tpot.observe_many(self.labels, (metrics.tpot_s,))

    def live_ttft_p50(self, seconds: float) -> None:
        self._live_ttft.set(seconds)
