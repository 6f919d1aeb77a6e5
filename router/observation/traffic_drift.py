"""Live traffic against the traffic its shape was chosen for.

``python -m loadgen advise`` picks a shape for a workload and writes what it measured
(mean prompt and output lengths, the request rate the shape served within its
objectives) into the YAML as ``router.traffic_profile``. The router compares its last
``window_requests`` answered requests with that profile and exports each ratio, so a
dashboard or an alert can say when the shape should be advised again.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from prometheus_client import Gauge

from router.settings import TrafficProfile

logger = logging.getLogger("splitserve.router")


@dataclass(frozen=True)
class DriftReading:
    """Live over profiled, per quantity (1.0: as profiled), and which are too far."""

    ratios: dict[str, float]
    drifted: frozenset[str]


class TrafficDrift:
    def __init__(self, profile: TrafficProfile, ratio: Gauge, drifted: Gauge) -> None:
        self._profile = profile
        self._ratio = ratio
        self._drifted_gauge = drifted
        self._window: deque[tuple[float, int, int]] = deque(maxlen=profile.window_requests)
        self._drifted: frozenset[str] = frozenset()

    def observe(
        self, arrival: float, prompt_tokens: int, output_tokens: int
    ) -> DriftReading | None:
        """One answered request (``arrival``: its ``perf_counter()`` when it came in).
        None until the window is full: fewer requests say too little to act on."""
        self._window.append((arrival, prompt_tokens, output_tokens))
        if len(self._window) < self._profile.window_requests:
            return None
        reading = self._reading()
        for quantity, value in reading.ratios.items():
            self._ratio.labels(quantity).set(value)
            self._drifted_gauge.labels(quantity).set(int(quantity in reading.drifted))
        if reading.drifted != self._drifted:
            self._log_change(reading)
        self._drifted = reading.drifted
        return reading

    def _reading(self) -> DriftReading:
        profile = self._profile
        count = len(self._window)
        arrivals, prompts, outputs = zip(*self._window, strict=True)
        ratios = {
            "prompt_tokens": sum(prompts) / count / profile.prompt_tokens,
            "output_tokens": sum(outputs) / count / profile.output_tokens,
        }
        # Requests finish out of arrival order: the window's span is its arrivals' range.
        span = max(arrivals) - min(arrivals)
        if profile.request_rate is not None and span > 0:
            ratios["request_rate"] = (count - 1) / span / profile.request_rate
        tolerance = profile.tolerance
        drifted = frozenset(
            name for name, ratio in ratios.items() if not 1 / tolerance <= ratio <= tolerance
        )
        return DriftReading(ratios, drifted)

    def _log_change(self, reading: DriftReading) -> None:
        ratios = ", ".join(f"{name} {value:.2f}x" for name, value in reading.ratios.items())
        if reading.drifted:
            logger.warning(
                "live traffic has drifted from router.traffic_profile in %s (%s; tolerance"
                " %gx): the shape may no longer suit it, python -m loadgen advise can choose"
                " again",
                ", ".join(sorted(reading.drifted)),
                ratios,
                self._profile.tolerance,
            )
        else:
            logger.info("live traffic is back within router.traffic_profile (%s)", ratios)
