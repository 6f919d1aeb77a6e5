"""A served router records its traffic and reports drift from the profile in its YAML.

Synthetic engines (no model) keep this quick; the path from HTTP through the router to
the record and the drift gauges is the one vLLM engines take. The ``recorded`` model of
the model-free served tests' shared application (tests/support/shared_apps.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from deployments.launcher import RunningApp
from tests.support.shared_apps import (
    TRAFFIC_OUTPUT_TOKENS,
    TRAFFIC_PROMPT_TOKENS,
    TRAFFIC_RECORD,
    TRAFFIC_WINDOW,
    synthetic_models,
)

pytestmark = pytest.mark.serving

RECORDED = synthetic_models(Path())["recorded"]
WINDOW = TRAFFIC_WINDOW
PROMPT_TOKENS = 3 * TRAFFIC_PROMPT_TOKENS  # three times the profile's: drift
OUTPUT_TOKENS = TRAFFIC_OUTPUT_TOKENS  # as profiled


@pytest.fixture(scope="module")
def recording_app(model_free_app: RunningApp, serve_logs: Path) -> tuple[RunningApp, Path]:
    return model_free_app, serve_logs / TRAFFIC_RECORD


def _metric(text: str, name: str, quantity: str) -> float:
    prefix = f'{name}{{model="{RECORDED.name}",quantity="{quantity}"}} '
    line = next(line for line in text.splitlines() if line.startswith(prefix))
    return float(line[len(prefix) :])


def test_answered_requests_are_recorded_and_their_drift_exported(recording_app) -> None:
    app, record = recording_app
    body = {
        "model": RECORDED.name,
        "prompt": [7] * PROMPT_TOKENS,
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
    }
    for index in range(WINDOW):
        response = httpx.post(
            f"{app.base_url}/v1/completions", json={**body, "stream": index % 2 == 0}, timeout=30
        )
        assert response.status_code == 200, response.text
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    requests = [line for line in lines if "header" not in line]
    assert [(r["in"], r["out"]) for r in requests] == [(PROMPT_TOKENS, OUTPUT_TOKENS)] * WINDOW
    metrics = httpx.get(f"{app.base_url}/metrics", timeout=10).text
    assert _metric(metrics, "splitserve_traffic_drift_ratio", "prompt_tokens") == 3.0
    assert _metric(metrics, "splitserve_traffic_drift_ratio", "output_tokens") == 1.0
    assert _metric(metrics, "splitserve_traffic_drifted", "prompt_tokens") == 1.0
    assert _metric(metrics, "splitserve_traffic_drifted", "output_tokens") == 0.0
    assert _metric(metrics, "splitserve_traffic_drift_ratio", "prompt_tokens")  # as it reads
    assert (
        f'splitserve_traffic_drift_ratio{{model="{RECORDED.name}",quantity="request_rate"}}'
        not in metrics
    )
