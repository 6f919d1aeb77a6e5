"""Live Prometheus metrics: batched histograms bucket like Prometheus' own, labels per run."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loadgen.outputs.exposition import BatchedHistogram, Exposition
from splitserve.metric_catalogue import RUN_LABELS, Family


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_batched_histogram_uses_le_buckets() -> None:
    registry = CollectorRegistry()
    histogram = BatchedHistogram(
        Family("x_seconds", "histogram", "test", RUN_LABELS, (0.001, 0.01))
    )
    registry.register(histogram)
    labels = ("run", "tp", "general", "8")
    histogram.observe_many(labels, [0.0005, 0.001, 0.002])
    histogram.observe_many(labels, [5.0])
    samples = _samples(registry)
    base = (("qps", "8"), ("run", "run"), ("shape", "tp"), ("workload", "general"))

    def bucket(le: str) -> float:
        return samples[("x_seconds_bucket", tuple(sorted((*base, ("le", le)))))]

    assert (bucket("0.001"), bucket("0.01"), bucket("+Inf")) == (2, 3, 4)  # 0.001 <= 0.001
    assert samples[("x_seconds_count", base)] == 4
    assert samples[("x_seconds_sum", base)] == 5.0035
    histogram.observe_many(labels, [0.003])  # counts accumulate across scrapes
    assert _samples(registry)[("x_seconds_count", base)] == 5


def test_runs_have_their_own_series() -> None:
    exposition = Exposition()
    first = exposition.for_run("a", "tp", "general", float("inf"))
    second = exposition.for_run("b", "dp", "general", 8.0)
    first.request_sent(sent=3, in_flight=2)
    second.live_ttft_p50(0.25)
    samples = _samples(exposition.registry)
    a = (("qps", "inf"), ("run", "a"), ("shape", "tp"), ("workload", "general"))
    b = (("qps", "8"), ("run", "b"), ("shape", "dp"), ("workload", "general"))
    assert samples[("loadgen_sent_requests", a)] == 3
    assert samples[("loadgen_in_flight_requests", a)] == 2
    assert samples[("loadgen_live_ttft_p50_seconds", b)] == 0.25
    assert samples[("loadgen_target_qps", b)] == 8.0
