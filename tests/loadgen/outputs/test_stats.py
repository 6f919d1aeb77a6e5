"""Statistics against hand-computed cases: percentiles, token-accurate ITL, goodput."""

from __future__ import annotations

import math

import pytest

from loadgen.client.streaming import RequestRecord
from loadgen.outputs.stats import (
    Distribution,
    RequestMetrics,
    ServiceLevel,
    percentile,
    request_metrics,
    run_duration,
    summarize_run,
    token_gaps,
)


def test_percentile_interpolates_linearly() -> None:
    values = [10, 20, 30, 40, 50]
    assert percentile(values, 50) == 30
    assert percentile(values, 90) == pytest.approx(46.0)  # 40 + 0.6 * (50 - 40)
    assert percentile(values, 99) == pytest.approx(49.6)
    assert percentile([7.0], 95) == 7.0
    assert math.isnan(percentile([], 50))


def test_distribution_of_known_samples() -> None:
    d = Distribution.of([1.0, 2.0, 3.0, 4.0])
    assert (d.count, d.mean, d.p50) == (4, 2.5, 2.5)
    assert d.p90 == pytest.approx(3.7)
    assert d.p95 == pytest.approx(3.85)
    assert d.p99 == pytest.approx(3.97)
    assert d.ms()["mean"] == 2500.0
    assert Distribution.of([]).count == 0


def test_token_gaps_single_token_chunks() -> None:
    assert token_gaps([1.0, 1.5, 2.5], [1, 1, 1]) == [0.5, 1.0]


def test_token_gaps_spread_multi_token_chunks() -> None:
    # First chunk: 2 tokens at once (one 0 gap). Then 3 tokens after 0.6 s, 1 after 0.1 s.
    gaps = token_gaps([1.0, 1.6, 1.7], [2, 3, 1])
    assert gaps == pytest.approx([0.0, 0.2, 0.2, 0.2, 0.1])
    assert len(gaps) == 2 + 3 + 1 - 1  # tokens - 1
    assert sum(gaps) == pytest.approx(1.7 - 1.0)  # last token - first token


def _record(chunks: list[tuple[float, int]], **fields: object) -> RequestRecord:
    record = RequestRecord(index=0, input_len=8, output_len=sum(n for _, n in chunks))
    record.scheduled_at, record.sent_at = 100.0, 100.002
    record.chunk_times = [100.002 + t for t, _ in chunks]
    record.chunk_tokens = [n for _, n in chunks]
    record.done_at = record.chunk_times[-1] + 0.001 if chunks else 100.5
    record.outcome = "ok"
    for name, value in fields.items():
        setattr(record, name, value)
    return record


def test_request_metrics_from_multi_token_chunks() -> None:
    record = _record([(0.100, 1), (0.130, 3), (0.150, 1)], completion_tokens=5, prompt_tokens=8)
    m = request_metrics(record, run_start=99.0)
    assert m.ttft_s == pytest.approx(0.100)
    assert m.itl_s == pytest.approx((0.010, 0.010, 0.010, 0.020))
    assert m.tpot_s == pytest.approx(0.050 / 4)
    assert m.e2e_s == pytest.approx(0.151)
    assert m.send_lag_s == pytest.approx(0.002)
    assert m.scheduled_s == pytest.approx(1.0)
    assert (m.output_tokens, m.input_tokens, m.length_mismatch) == (5, 8, False)


def test_failed_request_has_no_latency_samples() -> None:
    record = _record([], outcome="rejected", status=503)
    m = request_metrics(record, run_start=99.0)
    assert (m.outcome, m.status, m.ttft_s, m.itl_s, m.output_tokens) == (
        "rejected",
        "503",
        None,
        (),
        0,
    )


def _metrics(
    index: int, ttft: float, tpot: float | None, outcome: str = "ok", **kw: object
) -> RequestMetrics:
    fields: dict[str, object] = {
        "index": index, "warmup": False, "outcome": outcome,
        "status": "200" if outcome == "ok" else "503", "error": None,
        "scheduled_s": 0.0, "sent_s": 0.0, "done_s": 2.0, "send_lag_s": 0.001,
        "input_len": 100, "output_len": 10, "prompt_tokens": 100,
        "output_tokens": 10 if outcome == "ok" else 0,
        "ttft_s": ttft if outcome == "ok" else None,
        "tpot_s": tpot if outcome == "ok" else None,
        "e2e_s": 1.0 if outcome == "ok" else None,
        "itl_s": (0.01, 0.03) if outcome == "ok" else (),
    }  # fmt: skip
    fields.update(kw)
    return RequestMetrics(**fields)  # type: ignore[arg-type]


def test_goodput_counts_requests_meeting_both_targets() -> None:
    metrics = [
        _metrics(0, ttft=0.100, tpot=0.020),  # meets both
        _metrics(1, ttft=0.300, tpot=0.020),  # TTFT too slow
        _metrics(2, ttft=0.100, tpot=0.050),  # TPOT too slow
        _metrics(3, ttft=0.150, tpot=None),  # one token: no TPOT to miss
        _metrics(4, ttft=0.0, tpot=None, outcome="rejected"),
    ]
    summary = summarize_run(metrics, duration_s=2.0, service_level=ServiceLevel(0.2, 0.03))
    assert summary.goodput == pytest.approx(2 / 2.0)
    assert summary.slo_attainment == pytest.approx(2 / 5)
    assert (summary.completed, summary.rejected, summary.errors) == (4, 1, 0)
    assert summary.failures_by_status == {"503": 1}
    only_ttft = summarize_run(metrics, 2.0, ServiceLevel(ttft_s=0.2))
    assert only_ttft.goodput == pytest.approx(3 / 2.0)
    assert summarize_run(metrics, 2.0).goodput is None


def test_summary_pools_every_sample_and_skips_warmup() -> None:
    metrics = [
        _metrics(0, ttft=0.1, tpot=0.02, itl_s=(0.01, 0.01, 0.01, 0.01)),
        _metrics(1, ttft=0.3, tpot=0.02, itl_s=(0.05,)),
        _metrics(2, ttft=9.9, tpot=0.02, warmup=True, itl_s=(9.0,)),
    ]
    summary = summarize_run(metrics, duration_s=4.0)
    assert summary.requests == 2
    # ITL over all 5 gaps (not the mean of per-request means, which would be 0.03).
    assert summary.itl.mean == pytest.approx(0.09 / 5)
    assert summary.itl.count == 5
    assert summary.ttft.p50 == pytest.approx(0.2)
    assert summary.request_throughput == pytest.approx(0.5)
    assert summary.output_token_throughput == pytest.approx(20 / 4.0)
    assert summary.total_token_throughput == pytest.approx(220 / 4.0)


def test_run_duration_runs_to_the_last_answer() -> None:
    metrics = [_metrics(0, 0.1, 0.01, done_s=3.0), _metrics(1, 0.1, 0.01, done_s=5.5),
               _metrics(2, 0.1, 0.01, warmup=True, done_s=9.0)]  # fmt: skip
    assert run_duration(metrics) == 5.5
