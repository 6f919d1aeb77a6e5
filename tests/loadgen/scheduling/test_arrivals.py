"""Arrival processes: Poisson rate and coefficient of variation, reproducibility, replay."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadgen.scheduling.arrivals import (
    ConstantArrivals,
    GammaArrivals,
    PoissonArrivals,
    TraceReplayArrivals,
    UnlimitedArrivals,
    format_qps,
    make_arrivals,
)

SAMPLES = 20_000


@pytest.mark.parametrize("rate", [1.0, 2.0, 4.0, 8.0])
def test_poisson_rate_and_cv(rate: float) -> None:
    schedule = PoissonArrivals(rate, seed=7).schedule(SAMPLES)
    gaps = np.diff(schedule)
    assert schedule[0] == 0.0
    assert np.all(gaps >= 0)
    assert (SAMPLES - 1) / schedule[-1] == pytest.approx(rate, rel=0.03)
    # Exponential gaps: standard deviation equals the mean.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)


def test_same_seed_same_schedule_other_seed_other_schedule() -> None:
    first = PoissonArrivals(4.0, seed=3).schedule(200)
    assert first == PoissonArrivals(4.0, seed=3).schedule(200)
    assert first != PoissonArrivals(4.0, seed=4).schedule(200)
    assert make_arrivals(4.0, "poisson", 3).schedule(200) == first


def test_gamma_is_reachable_by_name_with_its_burstiness() -> None:
    assert make_arrivals(2.0, "gamma", 1, burstiness=0.25) == GammaArrivals(2.0, 0.25, 1)
    with pytest.raises(ValueError, match="registered: constant, gamma, poisson"):
        make_arrivals(2.0, "weibull", 1)


def test_gamma_burstier_than_poisson() -> None:
    gaps = np.diff(GammaArrivals(2.0, shape=0.25, seed=1).schedule(SAMPLES))
    assert 1 / gaps.mean() == pytest.approx(2.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.1)  # 1 / sqrt(shape)


def test_unlimited_and_constant() -> None:
    assert UnlimitedArrivals().schedule(3) == [0.0, 0.0, 0.0]
    assert make_arrivals(math.inf, "poisson", 0).label == "inf"
    assert ConstantArrivals(4.0).schedule(3) == [0.0, 0.25, 0.5]
    assert format_qps(math.inf) == "inf" and format_qps(8.0) == "8" and format_qps(0.5) == "0.5"


def test_trace_replay_keeps_gaps_and_scales_them() -> None:
    timestamps = [100.0, 101.0, 101.5, 110.0]
    assert TraceReplayArrivals(timestamps).schedule(4) == [0.0, 1.0, 1.5, 10.0]
    assert TraceReplayArrivals(timestamps, time_scale=0.1).schedule(3) == pytest.approx(
        [0.0, 0.1, 0.15]
    )
    with pytest.raises(ValueError, match="has 4 arrivals"):
        TraceReplayArrivals(timestamps).schedule(5)


def test_rates_are_validated() -> None:
    with pytest.raises(ValueError):
        PoissonArrivals(0.0)
    with pytest.raises(ValueError):
        make_arrivals(2.0, "uniform", 0)
