"""single.yaml runs its engine in the router's process: when that engine dies, requests
fail at once with an OpenAI 503 and Retry-After, and the router starts a new engine in
its place (its health check, which Serve calls, finds the dead one) while the other
models' engines serve on; the model answers again with the new engine.

single.yaml's model is the first of the shapes' shared application
(tests/support/shared_apps.py): only its engine is killed.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from deployments.launcher import replica_engine_pids
from tests.support.served_apps import ServedApps
from tests.support.shared_apps import SHAPES, shared_app

pytestmark = pytest.mark.serving

RECOVERY_TIMEOUT_S = 180.0
SINGLE = SHAPES["single"]
REQUEST = {"model": SINGLE.name, "prompt": [1, 2, 3], "max_tokens": 3}


def _status(base_url: str, model: str = SINGLE.name) -> int | None:
    try:
        body = {**REQUEST, "model": model}
        return httpx.post(f"{base_url}/v1/completions", json=body, timeout=30).status_code
    except httpx.HTTPError:
        return None


def test_a_dead_engine_is_replaced_in_the_router(served_apps: ServedApps, serve_logs: Path) -> None:
    path = shared_app(serve_logs, "shapes", SHAPES)
    app = served_apps.get(str(path), restarts_expected=True)
    assert _status(app.base_url) == 200
    engine = SINGLE.engine("mixed", 0)
    dead = replica_engine_pids(engine)
    assert dead
    others = replica_engine_pids(SHAPES["dp"].engine("mixed", 0))
    for pid in dead:
        os.kill(pid, signal.SIGKILL)
    response = httpx.post(f"{app.base_url}/v1/completions", json=REQUEST, timeout=30)
    # The engine is gone, not the request wrong: unavailable, retry later.
    assert response.status_code == 503
    assert response.json()["error"]["code"] == 503
    assert int(response.headers["retry-after"]) >= 1
    assert _status(app.base_url, SHAPES["dp"].name) == 200  # another model serves on
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while _status(app.base_url) != 200:
        assert time.monotonic() < deadline, "the router did not start a new engine"
        time.sleep(1)
    assert replica_engine_pids(engine) and replica_engine_pids(engine).isdisjoint(dead)
    assert replica_engine_pids(SHAPES["dp"].engine("mixed", 0)) == others  # not restarted
