"""Transfer statistics add up from ranks to engines to the router, travel as vLLM's
connector stats, and render as the catalogue's KV families."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kv_transfer.metrics import KVTransferCollector, TransferTotals, sum_totals
from kv_transfer.object_store.stats import TransferStats, TransferStatsRecorder
from splitserve import metric_catalogue as catalogue


def _rank(rank: int, seconds: float, nbytes: int) -> TransferStats:
    recorder = TransferStatsRecorder(rank)
    recorder.observe("get", seconds, nbytes)
    recorder.count_load("pushed")
    stats = recorder.take()
    assert stats is not None
    return stats


def test_two_ranks_of_one_hand_over_count_it_once_and_their_time_side_by_side() -> None:
    # vLLM aggregates the ranks' stats into the first's, as for any connector.
    engine = _rank(0, 0.004, 1000).aggregate(_rank(1, 0.006, 1000))
    assert isinstance(engine, TransferStats)
    data = engine.data
    assert (data["parts"]["get"], data["handovers"]["get"], data["bytes"]["get"]) == (2, 1, 2000)
    assert data["loads"] == {"pushed": 2, "claimed": 0}
    # The two parts overlap in time: one hand-over took their mean, not their sum.
    assert engine.totals.handover_seconds() == 0.005
    assert engine.reduce()["get_handovers"] == 1


def test_what_was_taken_is_counted_once() -> None:
    recorder = TransferStatsRecorder(rank=0)
    assert recorder.take() is None
    recorder.observe("put", 0.001, 10)
    assert recorder.take() is not None
    assert recorder.take() is None


def test_engines_totals_sum_and_the_seconds_histogram_is_cumulative() -> None:
    first, second = TransferTotals(), TransferTotals()
    first.observe("put", 0.0001, 10, first_part=True)
    second.observe("put", 1e6, 20, first_part=True)  # above every bound
    totals = sum_totals([first.data, second.data])
    assert totals.data["bytes"]["put"] == 30
    buckets, seconds = totals.histogram("put")
    assert buckets[0] == (repr(catalogue.KV_SECONDS.buckets[0]), 1)
    assert buckets[-1] == ("+Inf", 2)
    assert seconds == 1e6 + 0.0001
    assert not totals.is_empty() and TransferTotals().is_empty()


def test_the_collector_renders_engines_statistics_and_the_ledger() -> None:
    totals = TransferTotals()
    totals.observe("get", 0.003, 4096, first_part=True)
    totals.count_load("claimed")
    ledger = {"transfers_total": {"loaded": 1, "expired": 2}, "live_transfers": 3, "live_bytes": 7}
    registry = CollectorRegistry()
    registry.register(KVTransferCollector(lambda: totals, lambda: ledger))
    text = generate_latest(registry).decode()
    for line in (
        f'{catalogue.KV_BYTES.total}{{op="get"}} 4096.0',
        f'{catalogue.KV_HANDOVERS.total}{{op="get"}} 1.0',
        f'{catalogue.KV_LOADS.total}{{path="claimed"}} 1.0',
        f'{catalogue.KV_TRANSFERS.total}{{outcome="expired"}} 2.0',
        f"{catalogue.KV_LIVE_TRANSFERS.name} 3.0",
        f'{catalogue.KV_SECONDS.name}_count{{op="get"}} 1.0',
    ):
        assert line in text, line


def test_nothing_is_rendered_before_the_first_reading() -> None:
    registry = CollectorRegistry()
    registry.register(KVTransferCollector(lambda: None, lambda: None))
    assert "splitserve_kv" not in generate_latest(registry).decode()
