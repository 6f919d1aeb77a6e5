"""Simulated engines under real Ray Serve: auto_scaled.yaml's role-free pool, whose
engines are Serve replicas of their own reached over the engine transport, keeping an
H100's time for Llama 3.1 8B (deployments.serve --simulate)."""

from __future__ import annotations

import concurrent.futures
import json
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dashboards.prometheus import ray_discovery_file
from deployments.launcher import config_path, simulated_config
from tests.support.served_apps import ServedApps

pytestmark = pytest.mark.serving

PROFILE = "h100-llama-3.1-8b"
PROMPT = [10 + (index * 7) % 240 for index in range(600)]


def _complete(base_url: str, model: str, max_tokens: int) -> httpx.Response:
    body: dict[str, Any] = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)


def test_a_simulated_pool_serves_splits_and_reports_its_engines(served_apps: ServedApps) -> None:
    app = served_apps.get(str(simulated_config(config_path("auto_scaled"), PROFILE)))
    model = httpx.get(f"{app.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
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


def _samples(text: str, name: str) -> dict[str, float]:
    """``name``'s value by replica label, summed over its other labels."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                replica = sample.labels.get("replica", "")
                values[replica] = values.get(replica, 0.0) + sample.value
    return values


def test_simulated_engines_export_vllms_metrics_through_ray(
    served_apps: ServedApps, ray_address: str
) -> None:
    app = served_apps.get(str(simulated_config(config_path("auto_scaled"), PROFILE)))
    model = httpx.get(f"{app.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    for _ in range(4):
        assert _complete(app.base_url, model, 8).status_code == 200
    deadline = time.monotonic() + 60  # Ray exports what its workers record every few seconds
    while True:
        text = _ray_metrics(ray_address)
        ttft = _samples(text, "ray_vllm_time_to_first_token_seconds_count")
        tokens = _samples(text, "ray_vllm_generation_tokens_total")
        if sum(ttft.values()) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert sum(ttft.values()) >= 4, sorted(ttft)
    assert all(name.startswith("engine-") for name in ttft), sorted(ttft)
    assert sum(tokens.values()) >= 4 * 8
    assert _samples(text, "ray_vllm_kv_cache_usage_perc"), "no KV cache gauge"
