"""What an engine's clients get from it, measured where its tokens leave: each request's
time to first token and time per output token, over a sliding window.

A scaled pool's engine replicas report these to Ray Serve (``record_autoscaling_stats``)
for the pool's autoscaling policy (engines/pool_scaling.py); the count of requests in
flight tells a replica being taken out when its last stream has finished.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engines.contract import EngineBackend
from engines.pool_scaling import TPOT_FLOOR_METRIC, TPOT_METRIC, TTFT_FLOOR_METRIC, TTFT_METRIC
from engines.protocol import (
    DeltaBatch,
    EngineStats,
    GenerateChunk,
    GenerateFailure,
    GenerateRequest,
    LoraAdapter,
)

# The TTFT a pool is sized by: most requests, not the one unlucky one.
TTFT_QUANTILE = 0.9
# How many requests the engine served alone are kept for its floors (what it gives one
# request with nothing else running: the part of TTFT and TPOT no engine count changes).
FLOOR_SAMPLES = 64


@dataclass(slots=True)
class _InFlight:
    subscriber: str
    submitted_at: float
    alone: bool  # nothing else was in flight when it arrived
    last_token_at: float | None = None


class SloMeter:
    """TTFT and TPOT of the requests an engine served over the last ``window_s``, and
    the same for requests it served alone (its floors, over the last FLOOR_SAMPLES)."""

    def __init__(
        self,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
        time_scale: float = 1.0,
    ) -> None:
        self._window_s = window_s
        self._clock = clock
        # A simulated engine's times are stretched by its time_scale; the pool's SLOs
        # are in the fleet's own time, so the signals are reported divided back.
        self._time_scale = time_scale
        self._in_flight: dict[str, _InFlight] = {}
        self._first_tokens: deque[tuple[float, float]] = deque()  # (when, seconds)
        self._gaps: deque[tuple[float, float, int]] = deque()  # (when, seconds, tokens)
        self._alone_first_tokens: deque[float] = deque(maxlen=FLOOR_SAMPLES)
        self._alone_gaps: deque[tuple[float, int]] = deque(maxlen=FLOOR_SAMPLES)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def submitted(self, request_id: str, subscriber: str) -> None:
        self._in_flight[request_id] = _InFlight(subscriber, self._clock(), not self._in_flight)

    def delivered(self, request_id: str, tokens: int, finished: bool) -> None:
        request = self._in_flight.get(request_id)
        if request is None:
            return
        now = self._clock()
        # Forget here too, not only when read: the samples stay bounded by the window
        # however seldom (or whether) anyone asks for the signals.
        self._forget_before(now - self._window_s)
        if request.last_token_at is None:
            self._first_tokens.append((now, now - request.submitted_at))
            if request.alone:
                self._alone_first_tokens.append(now - request.submitted_at)
        elif tokens > 0:
            self._gaps.append((now, now - request.last_token_at, tokens))
            if len(self._in_flight) == 1:
                self._alone_gaps.append((now - request.last_token_at, tokens))
        if tokens > 0:
            request.last_token_at = now
        if finished:
            del self._in_flight[request_id]

    def ended(self, request_id: str) -> None:
        """The request failed or was aborted: it stops counting, as it stops running."""
        self._in_flight.pop(request_id, None)

    def subscriber_gone(self, subscriber: str) -> None:
        """A router's stream ended: the engine aborts what it had sent."""
        for request_id, request in list(self._in_flight.items()):
            if request.subscriber == subscriber:
                del self._in_flight[request_id]

    def signals(self) -> dict[str, float]:
        """The window's TTFT (its 90th percentile, or the longest wait for a first token
        still running if that is longer: a queue that produces no first token must not
        read as idle) and its mean time per output token; and their floors, the same
        over requests the engine served alone (0 until it has served one alone)."""
        now = self._clock()
        self._forget_before(now - self._window_s)
        waits = [r.submitted_at for r in self._in_flight.values() if r.last_token_at is None]
        ttft = _quantile([s for _, s in self._first_tokens], TTFT_QUANTILE)
        if waits:
            ttft = max(ttft, now - min(waits))
        times = {
            TTFT_METRIC: ttft,
            TPOT_METRIC: _per_token([(s, n) for _, s, n in self._gaps]),
            TTFT_FLOOR_METRIC: _quantile(list(self._alone_first_tokens), TTFT_QUANTILE),
            TPOT_FLOOR_METRIC: _per_token(list(self._alone_gaps)),
        }
        in_fleet_time = {name: value / self._time_scale for name, value in times.items()}
        return in_fleet_time | {"in_flight": float(self.in_flight)}

    def _forget_before(self, cutoff: float) -> None:
        while self._first_tokens and self._first_tokens[0][0] < cutoff:
            self._first_tokens.popleft()
        while self._gaps and self._gaps[0][0] < cutoff:
            self._gaps.popleft()


def _per_token(gaps: list[tuple[float, int]]) -> float:
    tokens = sum(n for _, n in gaps)
    return sum(s for s, _ in gaps) / tokens if tokens else 0.0


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class MeteredHost:
    """An engine backend whose requests a ``SloMeter`` follows: the transport serves this
    in its stead. It is an ``EngineBackend`` itself, so every call reaches the engine
    (before, it lacked the adapter calls, and a scaled pool refused run-time LoRA)."""

    def __init__(self, host: EngineBackend, meter: SloMeter) -> None:
        self._host = host
        self.meter = meter

    async def submit(self, request: GenerateRequest) -> None:
        self.meter.submitted(request.request_id, request.subscriber)
        try:
            await self._host.submit(request)
        except BaseException:
            self.meter.ended(request.request_id)
            raise

    async def abort(self, request_id: str) -> None:
        self.meter.ended(request_id)
        await self._host.abort(request_id)

    async def deltas(self, subscriber: str) -> AsyncIterator[DeltaBatch]:
        stream = self._host.deltas(subscriber)
        try:
            async for batch in stream:
                self._observe(batch)
                yield batch
        finally:
            self.meter.subscriber_gone(subscriber)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    def stats(self) -> EngineStats:
        return self._host.stats()

    async def check_health(self) -> None:
        await self._host.check_health()

    async def add_lora(self, adapter: LoraAdapter) -> None:
        await self._host.add_lora(adapter)

    async def remove_lora(self, adapter: LoraAdapter) -> None:
        await self._host.remove_lora(adapter)

    def close_streams(self) -> None:
        self._host.close_streams()

    @property
    def dead(self) -> bool:
        return self._host.dead

    def shutdown(self) -> None:
        self._host.shutdown()

    def _observe(self, batch: DeltaBatch) -> None:
        for request_id, item in batch:
            if isinstance(item, GenerateChunk):
                finished = item.finish_reason is not None
                self.meter.delivered(request_id, len(item.token_ids), finished)
            elif isinstance(item, GenerateFailure):
                self.meter.ended(request_id)
