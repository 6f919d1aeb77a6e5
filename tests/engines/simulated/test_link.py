"""A decode engine's link takes in one hand-over's bytes at a time; latencies overlap."""

from __future__ import annotations

import pytest

from engines.simulated.link import HandoverLink
from splitserve.latency.profile import LatencyProfile, load_profile


def _profile(latency_s: float, bytes_per_s: float) -> LatencyProfile:
    shipped = load_profile("h100-llama-3.1-8b-tp1-pp1")
    return shipped.model_copy(
        update={
            "kv_bytes_per_token": 1000,
            "handover_bytes_per_s": bytes_per_s,
            "handover_latency_s": latency_s,
        }
    )


def test_a_burst_of_handovers_queues_on_the_link() -> None:
    link = HandoverLink(_profile(latency_s=0.001, bytes_per_s=1e6))  # 1 ms a token
    arrivals = [link.arrival(0.0, 10) for _ in range(3)]
    # 10 ms of bytes each, one after another; each then its 1 ms of latency.
    assert arrivals == pytest.approx([0.011, 0.021, 0.031])


def test_an_idle_link_starts_at_once_and_the_time_scale_stretches_it() -> None:
    link = HandoverLink(_profile(latency_s=0.001, bytes_per_s=1e6), time_scale=10.0)
    assert link.arrival(0.0, 10) == pytest.approx(0.11)
    # Long after the first, the second waits for nothing.
    assert link.arrival(5.0, 10) == pytest.approx(5.11)
    # Ready while the second's bytes still move: it follows them.
    assert link.arrival(5.05, 10) == pytest.approx(5.21)
