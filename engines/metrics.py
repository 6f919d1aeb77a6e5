"""vLLM's own engine metrics from every replica, through Ray's metrics, labelled by replica.

vLLM's ``RayPrometheusStatLogger`` records its usual metrics (running and waiting
requests, KV cache usage, prefix cache queries and hits, TTFT, TPOT, ...) with
``ray.util.metrics``, so Ray's per-node metrics endpoint exports them and no replica
needs a port of its own. Its only replica label is Serve's opaque ``ReplicaId``; the
class built here adds ``replica`` (``engine-0``, ``prefill-0``) and ``role`` to every
series, so dashboards can tell the prefill pool from the decode pool.

Ray renames ``vllm:x`` to ``ray_vllm_x``; dashboards/prometheus.yml renames it back to
``vllm:x`` at scrape time, vLLM's documented names.
"""

from __future__ import annotations

from typing import Any


def _tagged(wrapper: type, tags: dict[str, str]) -> type:
    """A vLLM Ray metric wrapper whose every series also carries ``tags``."""

    class Tagged(wrapper):  # type: ignore[misc, valid-type]
        @staticmethod
        def _get_tag_keys(labelnames: list[str] | None) -> tuple[str, ...]:
            return (*wrapper._get_tag_keys(labelnames), *tags)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._tags = {**self._tags, **tags}

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


def replica_stat_logger(replica: str, role: str) -> type:
    """vLLM's Ray stat logger class, with ``replica`` and ``role`` on every series.

    Pass the class itself in ``AsyncLLM(stat_loggers=[...])``: being a
    ``PrometheusStatLogger`` it replaces vLLM's default one, whose registry nobody
    serves inside a Serve replica.
    """
    from vllm.v1.metrics import ray_wrappers as rw

    tags = {"replica": replica, "role": role}
    gauge = _tagged(rw.RayGaugeWrapper, tags)
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
