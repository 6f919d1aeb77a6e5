"""Simulated engines under real Ray Serve: auto_scaled.yaml's auto pool, whose
engines are Serve replicas of their own reached over the engine transport, keeping an
H100's time for Llama 3.1 8B (deployments.serve --simulate): the ``simulated`` model of
the model-free served tests' shared application (tests/support/shared_apps.py)."""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dashboards.prometheus import ray_discovery_file
from deployments.launcher import RunningApp
from tests.conftest import RAY_METRICS_EXPORT_MS
from tests.support.shared_apps import synthetic_models

pytestmark = pytest.mark.serving

MODEL = synthetic_models(Path())["simulated"].name
TTFT_COUNT = "ray_vllm_time_to_first_token_seconds_count"
PROMPT = [10 + (index * 7) % 240 for index in range(600)]


def _complete(base_url: str, model: str, max_tokens: int) -> httpx.Response:
    body: dict[str, Any] = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)


def test_a_simulated_pool_serves_splits_and_reports_its_engines(model_free_app: RunningApp) -> None:
    app, model = model_free_app, MODEL
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: _complete(app.base_url, model, 16), range(16)))
    assert all(response.status_code == 200 for response in responses), [
        r.text for r in responses if r.status_code != 200
    ]
    assert all(r.json()["usage"]["completion_tokens"] == 16 for r in responses)
    placements = {r.headers["x-splitserve-prefill"].split(":")[0] for r in responses}
    assert placements <= {"local", "remote"}
    health = httpx.get(f"{app.base_url}/health", timeout=10).json()
    assert health["status"] == "ok"
    # The same prompt again: the engine that computed it holds its blocks, and says so.
    again = _complete(app.base_url, model, 2)
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def _ray_metrics(ray_address: str) -> str:
    """Every node's Ray metrics page, as Prometheus would scrape them."""
    groups = json.loads(ray_discovery_file(ray_address).read_text())
    pages = [
        httpx.get(f"http://{target}/metrics", timeout=10).text
        for group in groups
        for target in group["targets"]
    ]
    return "\n".join(pages)


Labels = frozenset[tuple[str, str]]


def _samples(text: str, name: str) -> dict[Labels, float]:
    """``name``'s value by label set (one series per engine process)."""
    return {
        frozenset(sample.labels.items()): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def _added(before: dict[Labels, float], after: dict[Labels, float]) -> dict[Labels, float]:
    """The series that grew, by how much."""
    grown = {labels: value - before.get(labels, 0.0) for labels, value in after.items()}
    return {labels: value for labels, value in grown.items() if value > 0}


def test_simulated_engines_export_vllms_metrics_through_ray(
    model_free_app: RunningApp, ray_address: str
) -> None:
    app, model = model_free_app, MODEL
    # The cluster is shared: earlier applications' engines export the same names, so
    # only what these requests add counts.
    before = _samples(_ray_metrics(ray_address), TTFT_COUNT)
    for _ in range(4):
        assert _complete(app.base_url, model, 8).status_code == 200
    deadline = time.monotonic() + 60  # Ray exports what its workers record every few seconds
    while True:
        text = _ray_metrics(ray_address)
        ttft = _added(before, _samples(text, TTFT_COUNT))
        if sum(ttft.values()) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert sum(ttft.values()) >= 4, ttft
    assert all(dict(labels)["replica"].startswith("engine-") for labels in ttft), ttft
    assert all(dict(labels)["model_name"] == model for labels in ttft), ttft
    tokens = _samples(text, "ray_vllm_generation_tokens_total")
    assert sum(tokens.get(labels, 0.0) for labels in ttft) >= 4 * 8
    # Ray drops a gauge series not set for two export intervals; an idle engine's gauges
    # still read their last value, as on bare vLLM's /metrics.
    time.sleep(3 * RAY_METRICS_EXPORT_MS / 1000)
    gauges = _samples(_ray_metrics(ray_address), "ray_vllm_kv_cache_usage_perc")
    assert ttft.keys() <= gauges.keys(), "an idle engine's KV cache gauge left the export"
