"""The engine-state poller reads the engines' load every ``stats_interval_s`` and the KV
backend's ledger (a call to the KV directory actor each) only every
``kv_metrics_interval_s``; the engines' transfer statistics come with their load."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from kv_transfer.metrics import TransferTotals
from router.pool.stats_poller import EngineStatsPoller, summed_transfer_totals


class _StartingReplica:
    """A replica whose stats calls fail (it is starting): counted, nothing else needed."""

    name, role, healthy = "engine-0", "mixed", True

    def __init__(self) -> None:
        self.link = self
        self.state = SimpleNamespace(engine=None)
        self.polls = 0

    async def stats(self) -> Any:
        self.polls += 1
        raise ConnectionError("starting")


class _CountingKV:
    def __init__(self) -> None:
        self.reads = 0

    async def ledger_snapshot(self) -> dict[str, Any]:
        self.reads += 1
        return {"transfers_total": {}, "live_transfers": 0, "live_bytes": 0}


async def test_the_kv_ledger_is_read_once_per_kv_interval_not_per_load_poll() -> None:
    replica, kv = _StartingReplica(), _CountingKV()
    poller = EngineStatsPoller(
        [replica],  # type: ignore[arg-type]
        metrics=None,  # type: ignore[arg-type]
        interval_s=0.01,
        unhealthy_after_failed_polls=1_000,
        kv=kv,  # type: ignore[arg-type]
        kv_interval_s=0.2,
    )
    poller.start()
    try:
        while kv.reads < 3:
            await asyncio.sleep(0.01)
    finally:
        assert poller._task is not None
        poller._task.cancel()
    # About twenty load polls to each KV read; two or more even on a slow machine.
    assert replica.polls >= 2 * kv.reads, (replica.polls, kv.reads)
    assert poller.kv_ledger is not None
    assert poller.kv_transfer_totals is None  # no engine has reported moving KV


def _engine_with(put_bytes: int | None) -> Any:
    """A pooled engine whose last stats report ``put_bytes`` put (None: no statistics)."""
    if put_bytes is None:
        return SimpleNamespace(state=SimpleNamespace(engine=SimpleNamespace(kv_transfer=None)))
    totals = TransferTotals()
    totals.observe("put", 0.002, put_bytes, first_part=True)
    stats = SimpleNamespace(kv_transfer=totals.data)
    return SimpleNamespace(state=SimpleNamespace(engine=stats))


def test_the_engines_transfer_statistics_are_summed() -> None:
    engines = [_engine_with(1000), _engine_with(None), _engine_with(500)]
    totals = summed_transfer_totals(engines)  # type: ignore[arg-type]
    assert totals is not None
    assert totals.data["bytes"]["put"] == 1500
    assert totals.data["handovers"]["put"] == 2
    assert sum(totals.data["seconds_buckets"]["put"]) == 2
    no_statistics = [_engine_with(None)]
    assert summed_transfer_totals(no_statistics) is None  # type: ignore[arg-type]
