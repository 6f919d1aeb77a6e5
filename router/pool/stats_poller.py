"""What each engine reports about its load, polled in the background.

The router reads the latest snapshot when it routes; the same numbers are exported
as gauges so a dashboard (and the tests) see what the router sees.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from engines.protocol import EngineStats
from kv_transfer import KVRouterSide
from kv_transfer.metrics import TransferTotals, sum_totals
from router.observation.metrics import ModelMetrics
from router.pool.engine_pool import EnginePool
from router.pool.engine_state import MovingAverage
from router.pool.pooled_engine import PooledEngine

# How vLLM counts prompt tokens whose KV came from another engine (EngineStats).
TRANSFERRED_TOKENS = "external_kv_transfer"


class TransferCostMeter:
    """Seconds of KV hand-over per transferred prompt token: between two readings, the
    engines' put and load seconds over the prompt tokens they report as transferred,
    averaged over the intervals that moved any."""

    def __init__(self, ema_weight: float) -> None:
        self.seconds_per_token = MovingAverage(ema_weight)
        self._last: tuple[float, int] | None = None

    def update(self, totals: TransferTotals, transferred_tokens: int) -> None:
        seconds = totals.handover_seconds()
        last, self._last = self._last, (seconds, transferred_tokens)
        if last is None:
            return
        new_seconds, new_tokens = seconds - last[0], transferred_tokens - last[1]
        # An engine that restarted counts from zero again: no sample from that interval.
        if new_tokens > 0 and new_seconds >= 0:
            self.seconds_per_token.add(new_seconds / new_tokens)

    def estimate_s(self, tokens: int) -> float | None:
        """The hand-over's expected time for a prompt of ``tokens``; None until measured."""
        per_token = self.seconds_per_token.value
        return None if per_token is None else per_token * tokens


def transferred_tokens(pool: EnginePool) -> int:
    """Prompt tokens whose KV the pool's engines report as handed over to them."""
    return sum(
        engine.state.engine.prompt_tokens.get(TRANSFERRED_TOKENS, 0)
        for engine in pool
        if engine.state.engine is not None
    )


def summed_transfer_totals(pool: EnginePool) -> TransferTotals | None:
    """Every engine's transfer statistics added up; None where none moved KV."""
    reported = [
        engine.state.engine.kv_transfer
        for engine in pool
        if engine.state.engine is not None and engine.state.engine.kv_transfer is not None
    ]
    return sum_totals(reported) if reported else None


logger = logging.getLogger("splitserve.router")


class EngineStatsPoller:
    def __init__(
        self,
        pool: EnginePool,
        metrics: ModelMetrics,
        interval_s: float,
        unhealthy_after_failed_polls: int,
        kv: KVRouterSide | None = None,
        ema_weight: float = 0.2,
        kv_interval_s: float = 1.0,
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._interval_s = interval_s
        self._kv = kv
        self._kv_interval_s = kv_interval_s
        self._kv_polled_at = -math.inf
        self._unhealthy_after = unhealthy_after_failed_polls
        self._failed_polls: dict[str, int] = {}
        # The engines' summed transfer statistics and the KV backend's ledger as last
        # read (PD only), rendered at scrape time.
        self.kv_transfer_totals: TransferTotals | None = None
        self.kv_ledger: dict[str, Any] | None = None
        self.transfer_cost = TransferCostMeter(ema_weight)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            started = time.perf_counter()
            polls = [self._poll(engine) for engine in self._pool]
            # The ledger is a call to the backend (the directory actor): read it less often
            # than the engines' load, and measure the hand-over over the same span, long
            # enough that a transfer's seconds and its tokens fall in the same one.
            kv_due = self._kv is not None and started - self._kv_polled_at >= self._kv_interval_s
            if kv_due and self._kv is not None:
                self._kv_polled_at = started
                polls.append(self._poll_kv_ledger(self._kv))
            await asyncio.gather(*polls)
            self.kv_transfer_totals = summed_transfer_totals(self._pool)
            if kv_due and self.kv_transfer_totals is not None:
                self.transfer_cost.update(self.kv_transfer_totals, transferred_tokens(self._pool))
            elapsed = time.perf_counter() - started
            await asyncio.sleep(max(0.0, self._interval_s - elapsed))

    async def _poll_kv_ledger(self, kv: KVRouterSide) -> None:
        try:
            self.kv_ledger = await asyncio.wait_for(
                kv.ledger_snapshot(), timeout=max(1.0, 5 * self._interval_s)
            )
        except Exception as error:
            logger.debug("no KV ledger: %s", error)

    async def _poll(self, engine: PooledEngine) -> None:
        try:
            stats: EngineStats = await asyncio.wait_for(
                engine.link.stats(), timeout=max(1.0, 5 * self._interval_s)
            )
        except Exception as error:  # a engine that is starting or gone: keep the last view
            logger.debug("no stats from %s: %s", engine.name, error)
            failures = self._failed_polls.get(engine.name, 0) + 1
            self._failed_polls[engine.name] = failures
            if failures >= self._unhealthy_after:
                engine.healthy = False
            return
        self._failed_polls[engine.name] = 0
        engine.healthy = True
        engine.state.update_engine(stats)
        labels = (engine.name, engine.role)
        gauges = self._metrics
        gauges.engine_requests.labels(*labels, "running").set(stats.num_running)
        gauges.engine_requests.labels(*labels, "waiting").set(stats.num_waiting)
        gauges.engine_requests.labels(*labels, "unfinished").set(stats.num_unfinished)
        gauges.engine_kv_cache_usage.labels(*labels).set(stats.kv_cache_usage)
        for source, tokens in stats.prompt_tokens.items():
            gauges.engine_prompt_tokens.labels(*labels, source).set(tokens)
        gauges.engine_stats_age.labels(*labels).set(max(0.0, time.time() - stats.reported_at))
        state = engine.state
        if state.prefill_s_per_token.value is not None:
            gauges.prefill_seconds_per_token.labels(engine.name).set(
                state.prefill_s_per_token.value
            )
        if state.step_s.value is not None:
            gauges.decode_step_seconds.labels(engine.name).set(state.step_s.value)
