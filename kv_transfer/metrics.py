"""Transfer metrics: the aggregate, and a Prometheus view of the catalogue's KV families.

Transfers happen in vLLM engine processes, which nobody scrapes. Each put and each load
is therefore reported to the directory actor, which aggregates plain numbers in a
``TransferStats``; ``KVObjectDirectory.metrics_snapshot()`` returns them, and the router
turns a snapshot into Prometheus metrics with ``KVTransferCollector``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import Any, Literal

from splitserve import metric_catalogue as catalogue

Operation = Literal["put", "get"]
OPERATIONS: tuple[Operation, ...] = ("put", "get")
# loaded: every part written into a decode engine's cache; expired: TTL passed first;
# failed: layout mismatch, lost object or load error; released: freed unused (the
# decode side had every block in its prefix cache, the router or an abort gave it up).
Outcome = Literal["loaded", "expired", "failed", "released"]
OUTCOMES: tuple[Outcome, ...] = ("loaded", "expired", "failed", "released")
# How a decode rank got the part it loaded: pushed to it ahead of the request (and
# fetched then), or claimed from the directory when the load was due.
LoadPath = Literal["pushed", "claimed"]
LOAD_PATHS: tuple[LoadPath, ...] = ("pushed", "claimed")


class _Histogram:
    """Cumulative-bucket histogram in plain numbers, as Prometheus exposes it."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self._upper_bounds = buckets
        self._counts = [0] * (len(buckets) + 1)  # last slot: above every bound (+Inf)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._upper_bounds, value)] += 1
        self._sum += value

    def snapshot(self) -> dict[str, Any]:
        cumulative, running = [], 0
        for bound, count in zip((*self._upper_bounds, float("inf")), self._counts, strict=True):
            running += count
            cumulative.append((bound, running))
        return {"buckets": cumulative, "sum": self._sum, "count": running}


class TransferStats:
    """What the directory counts: bytes and seconds per operation, transfers by outcome."""

    def __init__(self) -> None:
        self._bytes = dict.fromkeys(OPERATIONS, 0)
        self._seconds = {op: _Histogram(catalogue.KV_SECONDS.buckets) for op in OPERATIONS}
        self._outcomes = dict.fromkeys(OUTCOMES, 0)
        self._loads = dict.fromkeys(LOAD_PATHS, 0)

    def observe(self, op: Operation, seconds: float, nbytes: int) -> None:
        self._bytes[op] += nbytes
        self._seconds[op].observe(seconds)

    def count_outcome(self, outcome: Outcome) -> None:
        self._outcomes[outcome] += 1

    def count_load(self, path: LoadPath) -> None:
        self._loads[path] += 1

    def snapshot(self, live_transfers: int, live_bytes: int) -> dict[str, Any]:
        return {
            "bytes_total": dict(self._bytes),
            "seconds": {op: hist.snapshot() for op, hist in self._seconds.items()},
            "transfers_total": dict(self._outcomes),
            "loads_total": dict(self._loads),
            "live_transfers": live_transfers,
            "live_bytes": live_bytes,
        }


def handover_seconds(snapshot: dict[str, Any]) -> float:
    """Seconds spent handing KV over since the directory started, put and load, as one
    transfer's ranks spend them side by side (parts of one transfer overlap)."""
    seconds = snapshot["seconds"]
    total = seconds["put"]["sum"] + seconds["get"]["sum"]
    loaded = snapshot["transfers_total"].get("loaded", 0)
    parts_per_transfer = max(1.0, seconds["get"]["count"] / loaded) if loaded else 1.0
    return total / parts_per_transfer


class KVTransferCollector:
    """A prometheus-client collector that renders the latest directory snapshot.

    ``snapshot_source`` returns the last ``metrics_snapshot()`` (or None before the
    first one); fetch it from the directory outside the scrape, e.g. in the router's
    polling loop, so a scrape never waits on Ray.
    """

    def __init__(self, snapshot_source: Callable[[], dict[str, Any] | None]) -> None:
        self._snapshot_source = snapshot_source

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        snapshot = self._snapshot_source()
        if snapshot is None:
            return
        family = catalogue.KV_BYTES
        nbytes = CounterMetricFamily(family.name, family.help, labels=family.labels)
        for op, value in snapshot["bytes_total"].items():
            nbytes.add_metric([op], value)
        yield nbytes
        family = catalogue.KV_SECONDS
        seconds = HistogramMetricFamily(family.name, family.help, labels=family.labels)
        for op, hist in snapshot["seconds"].items():
            buckets = [(_bound_label(bound), count) for bound, count in hist["buckets"]]
            seconds.add_metric([op], buckets, sum_value=hist["sum"])
        yield seconds
        family = catalogue.KV_TRANSFERS
        outcomes = CounterMetricFamily(family.name, family.help, labels=family.labels)
        for outcome, value in snapshot["transfers_total"].items():
            outcomes.add_metric([outcome], value)
        yield outcomes
        family = catalogue.KV_LOADS
        loads = CounterMetricFamily(family.name, family.help, labels=family.labels)
        for path, value in snapshot.get("loads_total", {}).items():
            loads.add_metric([path], value)
        yield loads
        for family, value in (
            (catalogue.KV_LIVE_TRANSFERS, snapshot["live_transfers"]),
            (catalogue.KV_LIVE_BYTES, snapshot["live_bytes"]),
        ):
            yield GaugeMetricFamily(family.name, family.help, value)


def _bound_label(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
