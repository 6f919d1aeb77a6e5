"""The engine-state poller reads the engines' load every ``stats_interval_s`` and the KV
backend's metrics (a call to the KV directory actor each) only every
``kv_metrics_interval_s``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from router.pool.engine_state import EngineStatePoller


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

    async def metrics_snapshot(self) -> dict[str, Any]:
        self.reads += 1
        timing = {"sum": 0.0, "count": 0}
        return {"seconds": {"put": timing, "get": timing}, "transfers_total": {}}


async def test_the_kv_metrics_are_read_once_per_kv_interval_not_per_load_poll() -> None:
    replica, kv = _StartingReplica(), _CountingKV()
    poller = EngineStatePoller(
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
    assert poller.kv_transfer_snapshot is not None
