"""The goodput search finds the knee: on a pure function, and on the load generator's
fake server given a known capacity (streams served at once / service time)."""

from __future__ import annotations

import json
from pathlib import Path

from loadgen.cli import main
from loadgen.fake_server import FakeServerConfig, fake_server_in_thread
from loadgen.knee import KneeSearchConfig, KneeStep, find_knee


def _step(qps: float, attainment: float) -> KneeStep:
    return KneeStep(qps, attainment, qps * attainment, qps, 0.01, 0.001)


async def test_the_search_brackets_then_halves_to_the_tolerance() -> None:
    tried: list[float] = []

    async def run_at(qps: float) -> KneeStep:
        tried.append(qps)
        return _step(qps, 1.0 if qps <= 12.0 else 0.5)

    config = KneeSearchConfig(attainment=0.9, qps_start=1, tolerance=0.05, max_steps=12)
    result = await find_knee(run_at, config)
    assert tried[:5] == [1, 2, 4, 8, 16]  # doubling until the first miss
    assert result.knee is not None and 12 / 1.05 <= result.knee.qps <= 12
    assert len(tried) <= 12
    assert [s.qps for s in result.curve] == sorted(tried)


async def test_no_knee_when_even_the_first_rate_misses() -> None:
    async def run_at(qps: float) -> KneeStep:
        return _step(qps, 0.0)

    result = await find_knee(run_at, KneeSearchConfig(max_steps=4))
    assert result.knee is None and len(result.steps) == 4


def test_the_knee_of_a_server_with_a_known_capacity(tmp_path: Path) -> None:
    # Two streams at a time, 20 ms to the first token, 8 tokens 2 ms apart: 34 ms each,
    # so at most ~59 requests/s; a 100 ms TTFT objective holds until the queue builds.
    config = FakeServerConfig(port=0, ttft_ms=20, itl_ms=2, max_concurrent=2)
    with fake_server_in_thread(config) as url:
        code = main([
            "knee", "--base-url", url, "--workload", "custom", "--input-len", "32",
            "--output-len", "8", "--num-requests", "80", "--warmup-requests", "2",
            "--slo-ttft-ms", "100", "--attainment", "0.9", "--qps-start", "8",
            "--max-steps", "7", "--tolerance", "0.15", "--no-server-metrics",
            "--out", str(tmp_path), "--no-plots",
        ])  # fmt: skip
    assert code == 0
    document = json.loads((tmp_path / "knee.json").read_text())
    knee = document["knee"]
    assert knee is not None and 20 <= knee["qps"] <= 62, document["curve"]
    misses = [step["qps"] for step in document["curve"] if step["attainment"] < 0.9]
    assert misses and min(misses) > knee["qps"]
    assert min(misses) <= 128  # the search found the wall, not the ceiling
