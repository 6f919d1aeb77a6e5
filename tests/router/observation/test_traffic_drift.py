"""The router compares live traffic with the profile its split was chosen for: ratios
over a full window, exported per quantity, and one log line when drift starts or ends."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest
from pydantic import ValidationError

from router.observation.metrics import ModelMetrics, RouterMetrics
from router.observation.traffic_drift import TrafficDrift
from router.settings import RouterConfig, TrafficProfile

PROFILE = TrafficProfile(
    prompt_tokens=1000, output_tokens=100, request_rate=4.0, window_requests=4, tolerance=1.5
)


def _drift(profile: TrafficProfile = PROFILE) -> tuple[TrafficDrift, ModelMetrics]:
    metrics = RouterMetrics().for_model("m")
    return TrafficDrift(profile, metrics.traffic_drift, metrics.traffic_drifted), metrics


def _sample(metrics: ModelMetrics, name: str, quantity: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model": "m", "quantity": quantity})


def test_nothing_is_said_until_the_window_is_full() -> None:
    drift, metrics = _drift()
    for index in range(3):
        assert drift.observe(index * 0.25, 1000, 100) is None
    assert "splitserve_traffic_drift_ratio{" not in generate_latest(metrics.registry).decode()


def test_traffic_as_profiled_reads_one_and_is_not_drift() -> None:
    drift, metrics = _drift()
    readings = [drift.observe(index * 0.25, 1000, 100) for index in range(4)]
    reading = readings[-1]
    assert reading is not None and not reading.drifted
    # Four arrivals 0.25 s apart: three gaps in 0.75 s, 4 req/s as profiled.
    assert reading.ratios == pytest.approx(
        {"prompt_tokens": 1.0, "output_tokens": 1.0, "request_rate": 1.0}
    )
    assert _sample(metrics, "splitserve_traffic_drift_ratio", "request_rate") == pytest.approx(1)
    assert _sample(metrics, "splitserve_traffic_drifted", "prompt_tokens") == 0


def test_longer_prompts_are_drift_once_they_fill_the_window_and_it_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    drift, metrics = _drift()
    for index in range(4):
        drift.observe(index * 0.25, 1000, 100)
    caplog.set_level(logging.INFO, logger="splitserve.router")
    ratios = []
    for index in range(4, 12):
        reading = drift.observe(index * 0.25, 3000, 100)
        assert reading is not None
        ratios.append(reading.ratios["prompt_tokens"])
    # The window slides: 1.5x, 2x, 2.5x, then 3x for as long as the long prompts last.
    assert ratios[:4] == pytest.approx([1.5, 2.0, 2.5, 3.0]) and ratios[-1] == pytest.approx(3)
    assert reading is not None and reading.drifted == {"prompt_tokens"}
    assert _sample(metrics, "splitserve_traffic_drifted", "prompt_tokens") == 1
    assert _sample(metrics, "splitserve_traffic_drifted", "output_tokens") == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "prompt_tokens" in warnings[0].getMessage()
    for index in range(12, 16):
        reading = drift.observe(index * 0.25, 1000, 100)
    assert reading is not None and not reading.drifted
    assert "back within" in caplog.records[-1].getMessage()


def test_a_slower_rate_is_drift_and_requests_finishing_out_of_order_count_by_arrival() -> None:
    drift, _ = _drift()
    reading = None
    for arrival in (3.0, 0.0, 2.0, 1.0):  # 1 req/s, finished out of order
        reading = drift.observe(arrival, 1000, 100)
    assert reading is not None
    assert reading.ratios["request_rate"] == pytest.approx(0.25)
    assert reading.drifted == {"request_rate"}


def test_without_a_profiled_rate_only_lengths_are_compared() -> None:
    drift, _ = _drift(PROFILE.model_copy(update={"request_rate": None}))
    reading = None
    for index in range(4):
        reading = drift.observe(index * 10.0, 1000, 160)
    assert reading is not None and set(reading.ratios) == {"prompt_tokens", "output_tokens"}
    assert reading.drifted == {"output_tokens"}  # 1.6x


@pytest.mark.parametrize(
    ("block", "field"),
    [
        ({"prompt_tokens": 0, "output_tokens": 1}, "prompt_tokens"),
        ({"prompt_tokens": 1, "output_tokens": 1, "tolerance": 1.0}, "tolerance"),
        ({"prompt_tokens": 1, "output_tokens": 1, "window_requests": 1}, "window_requests"),
        ({"prompt_tokens": 1, "output_tokens": 1, "rate": 2}, "rate"),
    ],
)
def test_a_bad_profile_names_its_field(block: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        RouterConfig(traffic_profile=block)
