"""Several router replicas (a Serve num_replicas override), each with engines of its own.

Synthetic engines (no model) keep this quick; the path from HTTP to the engine link is
the one vLLM engines take. Each router serves its own port by direct ingress and Serve's
proxy spreads over both: the model-free served tests' shared application
(tests/support/shared_apps.py), its ``routers`` model.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from deployments.launcher import RunningApp
from tests.support.shared_apps import SYNTHETIC_ROUTERS, synthetic_models

pytestmark = pytest.mark.serving

ROUTERS = SYNTHETIC_ROUTERS
MODEL = synthetic_models(Path())["routers"].name


@pytest.fixture(scope="module")
def two_routers(model_free_app: RunningApp) -> RunningApp:
    return model_free_app


def _stream(url: str, max_tokens: int) -> tuple[int, str | None]:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "stream": True}
    tokens, finish = 0, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                tokens += len(choice["text"])
                finish = choice.get("finish_reason") or finish
    return tokens, finish


def test_each_router_replica_answers_on_its_own_port(two_routers) -> None:
    routers = {httpx.get(f"{url}/health").json()["router"] for url in two_routers.router_urls}
    assert len(two_routers.router_urls) == ROUTERS
    assert len(routers) == ROUTERS
    for url in two_routers.router_urls:
        assert _stream(url, 40) == (40, "length")


def test_serves_proxy_spreads_over_the_router_replicas(two_routers) -> None:
    seen = {httpx.get(f"{two_routers.proxy_url}/health").json()["router"] for _ in range(30)}
    assert len(seen) == ROUTERS
    assert _stream(two_routers.proxy_url, 25) == (25, "length")
