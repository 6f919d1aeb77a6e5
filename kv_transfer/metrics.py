"""KV transfer figures: what the engines measured, what the directory holds, and the
router's Prometheus view of both (the catalogue's KV families).

Transfer statistics (bytes, seconds, hand-overs per operation, and how decode ranks got
their parts) are counted where the work happens, in each engine's connector, and reach
the router the way vLLM carries any connector's statistics: the connector's
``get_kv_connector_stats`` (kv_transfer/object_store/stats.py) hands them to vLLM,
which folds every rank's into the engine's ``SchedulerStats``; the engine's host adds
them up in the ``EngineStats`` the router already polls (engines/host.py), and the
router sums its engines'. Plain numbers, in a ``TransferTotals``.

The ledger (transfers by how they ended, what the object store still holds) is the
directory's alone: a transfer closes once there, whatever its ranks did. The router
reads it on its slow KV interval (``KVRouterSide.ledger_snapshot``).
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
_BUCKETS = catalogue.KV_SECONDS.buckets


def _empty_totals() -> dict[str, Any]:
    return {
        "bytes": dict.fromkeys(OPERATIONS, 0),
        # Parts moved (one per rank per transfer) and hand-overs (one per transfer: the
        # first rank's part counts it), so the time of one hand-over is known whatever
        # the engines' parallel sizes.
        "parts": dict.fromkeys(OPERATIONS, 0),
        "handovers": dict.fromkeys(OPERATIONS, 0),
        "seconds_sum": dict.fromkeys(OPERATIONS, 0.0),
        # Per bucket, not cumulative, the last above every bound: totals add up.
        "seconds_buckets": {op: [0] * (len(_BUCKETS) + 1) for op in OPERATIONS},
        "loads": dict.fromkeys(LOAD_PATHS, 0),
    }


class TransferTotals:
    """Transfer statistics in plain numbers that add up: a rank's, an engine's, a
    router's. ``data`` is what travels (vLLM's stats payload, ``EngineStats``)."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        self.data = data if data is not None else _empty_totals()

    def observe(self, op: Operation, seconds: float, nbytes: int, first_part: bool) -> None:
        """One part put or loaded; ``first_part``: the first rank's, which counts the
        hand-over."""
        data = self.data
        data["bytes"][op] += nbytes
        data["parts"][op] += 1
        data["handovers"][op] += int(first_part)
        data["seconds_sum"][op] += seconds
        data["seconds_buckets"][op][bisect.bisect_left(_BUCKETS, seconds)] += 1

    def count_load(self, path: LoadPath) -> None:
        self.data["loads"][path] += 1

    def add(self, other: dict[str, Any]) -> None:
        """Add another's ``data`` (same layout) to these."""
        data = self.data
        for key in ("bytes", "parts", "handovers", "seconds_sum", "loads"):
            for name, value in other[key].items():
                data[key][name] += value
        for op, counts in other["seconds_buckets"].items():
            mine = data["seconds_buckets"][op]
            for index, count in enumerate(counts):
                mine[index] += count

    def is_empty(self) -> bool:
        return not any(self.data["parts"].values())

    def handover_seconds(self) -> float:
        """Seconds spent handing KV over, put and load, as one hand-over's ranks spend
        them side by side (the parts of one hand-over overlap)."""
        data = self.data
        total = 0.0
        for op in OPERATIONS:
            handovers = data["handovers"][op]
            parts_per_handover = data["parts"][op] / handovers if handovers else 1.0
            total += data["seconds_sum"][op] / max(1.0, parts_per_handover)
        return total

    def histogram(self, op: Operation) -> tuple[list[tuple[str, int]], float]:
        """Prometheus's cumulative buckets of one operation's seconds, and their sum."""
        cumulative, running = [], 0
        bounds = (*_BUCKETS, float("inf"))
        for bound, count in zip(bounds, self.data["seconds_buckets"][op], strict=True):
            running += count
            cumulative.append((_bound_label(bound), running))
        return cumulative, self.data["seconds_sum"][op]


def sum_totals(datas: list[dict[str, Any]]) -> TransferTotals:
    totals = TransferTotals()
    for data in datas:
        totals.add(data)
    return totals


class Ledger:
    """What the directory counts: transfers by how they ended."""

    def __init__(self) -> None:
        self._outcomes = dict.fromkeys(OUTCOMES, 0)

    def count_outcome(self, outcome: Outcome) -> None:
        self._outcomes[outcome] += 1

    def snapshot(self, live_transfers: int, live_bytes: int) -> dict[str, Any]:
        return {
            "transfers_total": dict(self._outcomes),
            "live_transfers": live_transfers,
            "live_bytes": live_bytes,
        }


class KVTransferCollector:
    """A prometheus-client collector that renders the latest figures.

    ``totals_source`` returns the engines' summed ``TransferTotals`` and
    ``ledger_source`` the directory's last ``ledger_snapshot()`` (either None before
    the first); both are read outside the scrape, in the router's polling loop, so a
    scrape never waits on an engine or on Ray.
    """

    def __init__(
        self,
        totals_source: Callable[[], TransferTotals | None],
        ledger_source: Callable[[], dict[str, Any] | None],
    ) -> None:
        self._totals_source = totals_source
        self._ledger_source = ledger_source

    def collect(self) -> Iterator[Any]:
        totals = self._totals_source()
        if totals is not None:
            yield from _transfer_families(totals)
        ledger = self._ledger_source()
        if ledger is not None:
            yield from _ledger_families(ledger)


def _transfer_families(totals: TransferTotals) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    data = totals.data
    for family, values in (
        (catalogue.KV_BYTES, data["bytes"]),
        (catalogue.KV_HANDOVERS, data["handovers"]),
        (catalogue.KV_LOADS, data["loads"]),
    ):
        counter = CounterMetricFamily(family.name, family.help, labels=family.labels)
        for label, value in values.items():
            counter.add_metric([label], value)
        yield counter
    family = catalogue.KV_SECONDS
    seconds = HistogramMetricFamily(family.name, family.help, labels=family.labels)
    for op in OPERATIONS:
        buckets, total = totals.histogram(op)
        seconds.add_metric([op], buckets, sum_value=total)
    yield seconds


def _ledger_families(ledger: dict[str, Any]) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    family = catalogue.KV_TRANSFERS
    outcomes = CounterMetricFamily(family.name, family.help, labels=family.labels)
    for outcome, value in ledger["transfers_total"].items():
        outcomes.add_metric([outcome], value)
    yield outcomes
    for family, value in (
        (catalogue.KV_LIVE_TRANSFERS, ledger["live_transfers"]),
        (catalogue.KV_LIVE_BYTES, ledger["live_bytes"]),
    ):
        yield GaugeMetricFamily(family.name, family.help, value)


def _bound_label(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
