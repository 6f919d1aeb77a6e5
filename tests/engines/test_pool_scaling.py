"""A scaled pool's size from its engines' SLO measurements: the policy Serve runs
(engines/pool_scaling.py) and the meter each engine keeps (engines/slo_meter.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from engines.pool_scaling import (
    TPOT_FLOOR_METRIC,
    TPOT_METRIC,
    TTFT_FLOOR_METRIC,
    TTFT_METRIC,
    SloPolicy,
    desired_replicas,
    pool_pressure,
    with_one_fewer,
)
from engines.protocol import GenerateChunk, GenerateFailure, GenerateRequest
from engines.slo_meter import MeteredHost, SloMeter

UP, DOWN = 0.8, 0.6


@pytest.mark.parametrize(
    ("target", "pressure", "one_fewer", "wanted"),
    [
        (1, 0.9, 1.8, 2),  # over the upper line: one more
        (3, 5.0, 7.5, 4),  # far over: still one at a time
        (2, 0.5, 0.7, 2),  # one engine fewer would sit in the band: stay
        (2, 0.4, 0.6, 1),  # one engine fewer would sit at the lower line: shrink
        (3, 0.2, 0.3, 2),
        (1, 0.0, 0.0, 1),  # never below one
        (0, 0.0, 0.0, 1),
    ],
)
def test_the_pool_moves_one_engine_at_a_time_within_the_hysteresis(
    target: int, pressure: float, one_fewer: float, wanted: int
) -> None:
    assert desired_replicas(target, target, pressure, one_fewer, UP, DOWN) == wanted


def test_one_engine_fewer_keeps_the_floor_and_spreads_the_rest() -> None:
    # TTFT 0.5 s of which 0.4 s is what one request alone gets: over one engine fewer
    # of two, only the 0.1 s the load adds doubles.
    assert with_one_fewer(0.5, 0.4, 2) == pytest.approx(0.6)
    assert with_one_fewer(0.5, 0.0, 2) == pytest.approx(1.0)  # no floor measured yet
    assert with_one_fewer(0.3, 0.4, 3) == pytest.approx(0.3)  # below its floor: as it is


def test_while_an_engine_starts_the_count_holds_unless_shrinking_is_due() -> None:
    # One engine runs, Serve starts a second: the load has not reached it yet, so neither
    # more pressure nor a pressure in the band changes the aim (a first version compared
    # with the running count and had Serve stop the engine it was starting).
    assert desired_replicas(1, 2, 1.5, 3.0, UP, DOWN) == 2
    assert desired_replicas(1, 2, 0.5, 0.7, UP, DOWN) == 2
    assert desired_replicas(1, 2, 0.1, 0.2, UP, DOWN) == 1


def test_pressure_is_the_engines_mean_share_of_the_worse_slo() -> None:
    metrics = {
        TTFT_METRIC: {"a": 1.0, "b": 0.0},  # a: half the 2 s TTFT
        TPOT_METRIC: {"a": 0.01, "b": 0.04},  # b: 0.8 of the 50 ms TPOT
        TTFT_FLOOR_METRIC: {"a": 0.6},
        TPOT_FLOOR_METRIC: {"b": 0.02},
    }
    assert pool_pressure(metrics, 2.0, 0.05) == pytest.approx((0.5 + 0.8) / 2)
    # One engine fewer of two: a's TTFT 0.6 + 0.4 * 2 = 1.4 s (0.7), b's TPOT
    # 0.02 + 0.02 * 2 = 0.06 s (1.2).
    assert pool_pressure(metrics, 2.0, 0.05, one_fewer_of=2) == pytest.approx((0.7 + 1.2) / 2)
    assert pool_pressure({}, 2.0, 0.05) == 0.0


def test_serves_policy_reads_the_replicas_reports_and_keeps_its_pressure() -> None:
    policy = SloPolicy(ttft_slo_s=1.0, tpot_slo_s=0.05, scale_up_at=UP, scale_down_at=DOWN)
    ctx = SimpleNamespace(
        current_num_replicas=2,
        target_num_replicas=2,
        aggregated_metrics={TTFT_METRIC: {"r1": 1.5, "r2": 0.5}, TPOT_METRIC: {}},
    )
    wanted, state = policy(ctx)
    assert wanted == 3
    assert state["slo_pressure"] == pytest.approx(1.0)
    idle = {TTFT_METRIC: {"r1": 0.2, "r2": 0.2}, TTFT_FLOOR_METRIC: {"r1": 0.2, "r2": 0.2}}
    ctx.aggregated_metrics = idle
    assert policy(ctx)[0] == 1  # one engine fewer keeps the 0.2 s floor: 0.2 of the SLO


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_meter_reports_ttft_tpot_and_the_longest_wait_over_its_window() -> None:
    clock = _Clock()
    meter = SloMeter(window_s=10.0, clock=clock)
    meter.submitted("a", "router")
    clock.now += 0.5
    meter.delivered("a", 1, finished=False)  # TTFT 0.5
    clock.now += 0.1
    meter.delivered("a", 2, finished=False)  # 0.1 s for 2 tokens
    clock.now += 0.1
    meter.delivered("a", 2, finished=True)
    signals = meter.signals()
    assert signals[TTFT_METRIC] == pytest.approx(0.5)
    assert signals[TPOT_METRIC] == pytest.approx(0.05)
    assert signals["in_flight"] == 0
    # a was alone on the engine: its first token and gaps are the floors too.
    assert signals[TTFT_FLOOR_METRIC] == pytest.approx(0.5)
    assert signals[TPOT_FLOOR_METRIC] == pytest.approx(0.05)

    meter.submitted("b", "router")  # no first token yet: its wait counts
    clock.now += 3.0
    assert meter.signals()[TTFT_METRIC] == pytest.approx(3.0)
    clock.now += 20.0  # the finished request's samples age out; b still waits
    signals = meter.signals()
    assert signals[TPOT_METRIC] == 0.0
    assert signals[TTFT_METRIC] == pytest.approx(23.0)
    meter.subscriber_gone("router")
    signals = meter.signals()
    assert (signals[TTFT_METRIC], signals[TPOT_METRIC], signals["in_flight"]) == (0, 0, 0)
    # The floors outlive the window: they say what the engine is, not how busy it is.
    assert signals[TTFT_FLOOR_METRIC] == pytest.approx(0.5)


def test_requests_that_share_the_engine_do_not_count_for_its_floors() -> None:
    clock = _Clock()
    meter = SloMeter(window_s=10.0, clock=clock)
    meter.submitted("a", "router")
    meter.submitted("b", "router")  # arrives while a runs
    clock.now += 2.0
    meter.delivered("b", 1, finished=False)
    clock.now += 0.5
    meter.delivered("b", 1, finished=False)  # a still in flight: not alone
    signals = meter.signals()
    assert signals[TTFT_FLOOR_METRIC] == 0.0 and signals[TPOT_FLOOR_METRIC] == 0.0
    meter.ended("a")
    clock.now += 0.1
    meter.delivered("b", 2, finished=True)  # alone now: its gap is a floor sample
    assert meter.signals()[TPOT_FLOOR_METRIC] == pytest.approx(0.05)


def test_a_time_scaled_engine_reports_in_the_fleets_time() -> None:
    """A simulated engine stretched 10x takes 10x the wall time; the pool's SLOs are in
    the simulated fleet's time, and so are the signals."""
    clock = _Clock()
    meter = SloMeter(window_s=100.0, clock=clock, time_scale=10.0)
    meter.submitted("a", "router")
    clock.now += 5.0
    meter.delivered("a", 1, finished=False)
    clock.now += 1.0
    meter.delivered("a", 2, finished=True)
    signals = meter.signals()
    assert signals[TTFT_METRIC] == pytest.approx(0.5)
    assert signals[TPOT_METRIC] == pytest.approx(0.05)
    assert signals[TTFT_FLOOR_METRIC] == pytest.approx(0.5)
    assert signals[TPOT_FLOOR_METRIC] == pytest.approx(0.05)
    meter.submitted("b", "router")
    clock.now += 30.0
    assert meter.signals()[TTFT_METRIC] == pytest.approx(3.0)  # a wait counts the same


class _Host:
    """An engine host that answers each request with two one-token chunks."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    async def submit(self, request: GenerateRequest) -> None:
        if request.request_id == "bad":
            raise ValueError("refused")
        self._queue.put_nowait([(request.request_id, GenerateChunk([1], "a"))])
        self._queue.put_nowait([(request.request_id, GenerateChunk([2], "b", "stop"))])

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def deltas(self, subscriber: str) -> AsyncIterator[Any]:
        while True:
            yield await self._queue.get()

    def stats(self) -> str:
        return "stats"

    async def check_health(self) -> None:
        return None


def _request(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id, "router", [1, 2], SimpleNamespace(max_tokens=2))


def test_a_metered_host_counts_what_it_passes_on_and_forgets_what_ends() -> None:
    async def scenario() -> tuple[list[int], _Host]:
        host = _Host()
        # A partial fake (no adapters, a str for stats): only the calls MeteredHost passes on.
        metered = MeteredHost(host, SloMeter(window_s=10.0))  # type: ignore[arg-type]
        counts = []
        await metered.submit(_request("a"))
        await metered.submit(_request("c"))
        counts.append(metered.meter.in_flight)  # 2
        with pytest.raises(ValueError):
            await metered.submit(_request("bad"))
        counts.append(metered.meter.in_flight)  # still 2: the refused one never ran
        await metered.abort("c")
        counts.append(metered.meter.in_flight)  # 1
        stream = metered.deltas("router")
        assert isinstance(stream, AsyncGenerator)  # so that it can be closed
        await anext(stream)
        await anext(stream)  # a's last chunk: finished
        counts.append(metered.meter.in_flight)
        host._queue.put_nowait([("z", GenerateFailure("gone"))])
        await anext(stream)
        await stream.aclose()
        assert metered.stats() == "stats"
        return counts, host

    counts, host = asyncio.run(scenario())
    assert counts == [2, 2, 1, 0]
    assert host.aborted == ["c"]
