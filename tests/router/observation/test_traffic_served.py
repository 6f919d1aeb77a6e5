"""A served router records its traffic and reports drift from the profile in its YAML.

Synthetic engines (no model) keep this quick; the path from HTTP through the router to
the record and the drift gauges is the one vLLM engines take.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml

from deployments.launcher import RunningApp, config_path
from engines.tiny_model import EMBEDDED_MODEL_NAME
from tests.support.served_apps import ServedApps

pytestmark = pytest.mark.serving

WINDOW = 4
PROMPT_TOKENS = 30  # three times the profile's 10: drift
OUTPUT_TOKENS = 4  # as profiled


@pytest.fixture(scope="module")
def recording_app(
    served_apps: ServedApps, tmp_path_factory: pytest.TempPathFactory
) -> tuple[RunningApp, Path]:
    folder = tmp_path_factory.mktemp("traffic")
    record = folder / "traffic.jsonl"
    document = yaml.safe_load(config_path("dp").read_text())
    args = document["applications"][0]["args"]
    args["engine"] = {"backend": "synthetic"}
    args["router"] = {
        **args.get("router", {}),
        "traffic_record": str(record),
        "traffic_profile": {
            "prompt_tokens": 10,
            "output_tokens": OUTPUT_TOKENS,
            "window_requests": WINDOW,
        },
    }
    path = folder / "dp-recorded.yaml"
    path.write_text(yaml.safe_dump(document))
    return served_apps.get(str(path)), record


def _metric(text: str, name: str, quantity: str) -> float:
    prefix = f'{name}{{model="{EMBEDDED_MODEL_NAME}",quantity="{quantity}"}} '
    line = next(line for line in text.splitlines() if line.startswith(prefix))
    return float(line[len(prefix) :])


def test_answered_requests_are_recorded_and_their_drift_exported(recording_app) -> None:
    app, record = recording_app
    body = {
        "model": EMBEDDED_MODEL_NAME,
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
        f'splitserve_traffic_drift_ratio{{model="{EMBEDDED_MODEL_NAME}",quantity="request_rate"}}'
        not in metrics
    )
