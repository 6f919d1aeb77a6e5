"""The connector's transfer statistics, as vLLM carries any connector's.

Each worker rank counts its own puts and loads in a ``TransferStats`` (a
``KVConnectorStats`` whose payload is a ``TransferTotals``' plain numbers);
``get_kv_connector_stats`` hands over what was counted since the last call and starts
afresh. vLLM adds every rank's up (``aggregate``), puts them in the engine's
``SchedulerStats.kv_connector_stats``, and gives them back to a stat logger through
``build_kv_connector_stats``: the engine's host (engines/host.py) keeps a running total
for the router, and vLLM's own logging stat logger prints ``reduce()`` each interval.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kv_transfer.metrics import OPERATIONS, LoadPath, Operation, TransferTotals

MIB = 1 << 20


@dataclass
class TransferStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    @property
    def totals(self) -> TransferTotals:
        return TransferTotals(self.data)

    def reset(self) -> None:
        self.data = TransferTotals().data

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.data:
            self.totals.add(other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        data = self.data
        summary: dict[str, int | float] = {}
        for op in OPERATIONS:
            parts = data["parts"][op]
            summary[f"{op}_handovers"] = data["handovers"][op]
            summary[f"{op}_MiB"] = round(data["bytes"][op] / MIB, 3)
            summary[f"{op}_avg_ms"] = (
                round(1000 * data["seconds_sum"][op] / parts, 3) if parts else 0.0
            )
        summary.update({f"loads_{path}": count for path, count in data["loads"].items()})
        return summary

    def is_empty(self) -> bool:
        return self.totals.is_empty()


class TransferStatsRecorder:
    """A rank's counts since vLLM last took them. Its threads (the saver, the loaders)
    record while the model runner takes: one lock between them."""

    def __init__(self, rank: int) -> None:
        self._first_rank = rank == 0
        self._lock = threading.Lock()
        self._totals = TransferTotals()

    def observe(self, op: Operation, seconds: float, nbytes: int) -> None:
        with self._lock:
            self._totals.observe(op, seconds, nbytes, first_part=self._first_rank)

    def count_load(self, path: LoadPath) -> None:
        with self._lock:
            self._totals.count_load(path)

    def take(self) -> TransferStats | None:
        """What was counted since the last call, or None if nothing was."""
        with self._lock:
            if self._totals.is_empty():
                return None
            taken, self._totals = self._totals, TransferTotals()
        return TransferStats(data=taken.data)


class CountsTransferStats:
    """For a connector that counts its transfers in ``TransferStats``: vLLM's hook that
    turns the payload a stat logger gets back into them (put it before vLLM's base)."""

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TransferStats | None:
        return TransferStats(data=data) if data else None
