"""vLLM's own engine metrics from every replica, through Ray's metrics, labelled by replica.

vLLM's ``RayPrometheusStatLogger`` records its usual metrics (running and waiting
requests, KV cache usage, prefix cache queries and hits, TTFT, TPOT, ...) with
``ray.util.metrics``, so Ray's per-node metrics endpoint exports them and no replica
needs a port of its own. Its only replica label is Serve's opaque ``ReplicaId``; the
class built here adds ``replica`` (``engine-0``, ``prefill-0``) and ``role`` to every
series, so dashboards can tell the prefill pool from the decode pool.

Ray renames ``vllm:x`` to ``ray_vllm_x``; dashboards/prometheus.yml renames it back to
``vllm:x`` at scrape time, vLLM's documented names.

Ray exports a gauge only while it is being set: a series not set for two export
intervals drops out of the export. vLLM sets its gauges once per engine step, so an
idle engine's KV cache usage, running and waiting requests would vanish from the
dashboard instead of reading their last value, as they do on bare vLLM's ``/metrics``.
``_LastGaugeValues`` sets each series again every half interval while the process lives.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class _LastGaugeValues:
    """Every gauge series this process set, with its last value, set again every half of
    Ray's export interval by one daemon thread."""

    def __init__(self) -> None:
        self._values: dict[tuple[int, tuple[tuple[str, str], ...]], tuple[Any, float]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def set(self, metric: Any, tags: dict[str, str], value: float) -> None:
        # Under the lock, so that setting again never overwrites a newer value.
        with self._lock:
            metric.set(value, tags=tags)
            self._values[(id(metric), tuple(sorted(tags.items())))] = (metric, value)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._keep_exported, name="gauge-keeper", daemon=True
                )
                self._thread.start()

    def set_again(self) -> None:
        with self._lock:
            for (_, tags), (metric, value) in self._values.items():
                metric.set(value, tags=dict(tags))

    def _keep_exported(self) -> None:
        import ray

        period_s = ray._config.metrics_report_interval_ms() / 2000
        while True:
            time.sleep(period_s)
            self.set_again()


_last_gauge_values = _LastGaugeValues()


def _tagged(wrapper: Any, tags: dict[str, str]) -> type:
    """A vLLM Ray metric wrapper whose every series also carries ``tags``."""

    class Tagged(wrapper):
        @staticmethod
        def _get_tag_keys(labelnames: list[str] | None) -> tuple[str, ...]:
            return (*wrapper._get_tag_keys(labelnames), *tags)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # vLLM's wrapper sets _tags in its own __init__, untyped.
            self._tags = {**self._tags, **tags}  # type: ignore[has-type]

        def _build_tags(self, *labels: Any, **labelskwargs: Any) -> dict[str, str]:
            if labels:
                # vLLM's own keys come first; ReplicaId and ours follow.
                expected = len(self.metric._tag_keys) - 1 - len(tags)
                if len(labels) != expected:
                    raise ValueError(f"expected {expected} label values, got {len(labels)}")
                labelskwargs.update(zip(self.metric._tag_keys, labels, strict=False))
            return {**super()._build_tags(**labelskwargs), **tags}

    Tagged.__name__ = f"Tagged{wrapper.__name__}"
    return Tagged


def _kept_exported(gauge: Any) -> type:
    """A gauge wrapper whose series ``_last_gauge_values`` keeps in Ray's export."""

    class KeptGauge(gauge):
        def set(self, value: float) -> None:
            _last_gauge_values.set(self.metric, self._tags, value)

    KeptGauge.__name__ = f"Kept{gauge.__name__}"
    return KeptGauge


def replica_stat_logger(replica: str, role: str) -> type:
    """vLLM's Ray stat logger class, with ``replica`` and ``role`` on every series.

    Pass the class itself in ``AsyncLLM(stat_loggers=[...])``: being a
    ``PrometheusStatLogger`` it replaces vLLM's default one, whose registry nobody
    serves inside a Serve replica.
    """
    from vllm.v1.metrics import ray_wrappers as rw

    tags = {"replica": replica, "role": role}
    gauge = _kept_exported(_tagged(rw.RayGaugeWrapper, tags))
    counter = _tagged(rw.RayCounterWrapper, tags)
    histogram = _tagged(rw.RayHistogramWrapper, tags)
    metric_classes = {"_gauge_cls": gauge, "_counter_cls": counter, "_histogram_cls": histogram}
    return type(
        "ReplicaRayStatLogger",
        (rw.RayPrometheusStatLogger,),
        {
            **metric_classes,
            "_spec_decoding_cls": type(
                "ReplicaSpecDecodingProm", (rw.RaySpecDecodingProm,), {"_counter_cls": counter}
            ),
            "_kv_connector_cls": type(
                "ReplicaKVConnectorProm", (rw.RayKVConnectorProm,), metric_classes
            ),
            "_perf_metrics_cls": type(
                "ReplicaPerfMetricsProm", (rw.RayPerfMetricsProm,), {"_counter_cls": counter}
            ),
        },
    )
