"""single.yaml runs its engine in the router's process: when that engine dies, requests
fail at once with an OpenAI 503 and Retry-After, and Serve restarts the router (its
health check is the engine's), which comes back on the same port with a new engine."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from deployments.launcher import app_engine_pids
from tests.support.served_apps import ServedApps

pytestmark = pytest.mark.serving

RECOVERY_TIMEOUT_S = 180.0
REQUEST = {"model": "splitserve-tiny-llama", "prompt": [1, 2, 3], "max_tokens": 3}


def _status(base_url: str) -> int | None:
    try:
        return httpx.post(f"{base_url}/v1/completions", json=REQUEST, timeout=30).status_code
    except httpx.HTTPError:
        return None  # the router is restarting: nothing listens for a while


def test_a_dead_engine_restarts_its_router(served_apps: ServedApps) -> None:
    app = served_apps.get("single", restarts_expected=True)
    assert _status(app.base_url) == 200
    dead = app_engine_pids()
    assert dead
    for pid in dead:
        os.kill(pid, signal.SIGKILL)
    response = httpx.post(f"{app.base_url}/v1/completions", json=REQUEST, timeout=30)
    # The engine is gone, not the request wrong: unavailable, retry later.
    assert response.status_code == 503
    assert response.json()["error"]["code"] == 503
    assert int(response.headers["retry-after"]) >= 1
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while _status(app.base_url) != 200:
        assert time.monotonic() < deadline, "the router did not come back with a new engine"
        time.sleep(1)
    assert app_engine_pids().isdisjoint(dead)
