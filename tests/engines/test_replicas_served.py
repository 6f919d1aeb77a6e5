"""Engines in Serve replicas of their own (router.engine_in_router: false), reached over
the engine transport, behind two router replicas that share them.

Synthetic engines (no model) keep this quick: the path from HTTP through the router to
the engine replica's socket and back is the one vLLM engines take. The ``apart`` model
of the model-free served tests' shared application (tests/support/shared_apps.py).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Generator
from pathlib import Path

import httpx
import pytest

from deployments.launcher import ROUTER_DEPLOYMENT, RunningApp
from splitserve.processes import command_lines
from tests.support.served_apps import ServedApps
from tests.support.shared_apps import SYNTHETIC_ROUTERS, synthetic_app, synthetic_models
from tests.support.waiting import eventually

pytestmark = pytest.mark.serving

ROUTERS = SYNTHETIC_ROUTERS
# Its engines' steps are paced: a stream of a few hundred tokens lasts seconds, long
# enough to cut.
APART = synthetic_models(Path())["apart"]
ENGINES = (APART.engine("mixed", 0), APART.engine("mixed", 1))
RECOVERY_TIMEOUT_S = 120.0
RECOVERY_POLL_S = 0.5
# Within the context (4096): at STEP_INTERVAL_S a stream of 40 s, cut long before.
LONG_STREAM_TOKENS = 4000


@pytest.fixture(scope="module")
def engines_apart(served_apps: ServedApps, serve_logs: Path) -> RunningApp:
    # The tests kill engine replicas and a router: Serve restarts them.
    return served_apps.get(str(synthetic_app(serve_logs)), restarts_expected=True)


def _complete(url: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": APART.name, "prompt": [1, 2, 3], "max_tokens": max_tokens}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


def _replicas_seen(url: str, requests: int = 8) -> set[str]:
    seen = set()
    for _ in range(requests):
        response = _complete(url)
        assert response.status_code == 200, response.text
        seen.add(response.headers["x-splitserve-replica"])
    return seen


def _stream_events(url: str, max_tokens: int) -> Generator[dict, None, None]:
    body = {
        "model": APART.name,
        "prompt": [1, 2, 3],
        "max_tokens": max_tokens,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                yield json.loads(line[6:])


def _replica_pids(deployment: str) -> list[int]:
    title = f"ray::ServeReplica:splitserve:{deployment}"
    return [pid for pid, line in command_lines().items() if line.startswith(title)]


def _engine_requests(url: str, replica: str, state: str = "running") -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    labels = f'model="{APART.name}",replica="{replica}",role="mixed",state="{state}"'
    prefix = f"splitserve_engine_requests{{{labels}}}"
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return float("nan")


def test_every_router_reaches_every_engine(engines_apart: RunningApp) -> None:
    for url in engines_apart.router_urls:
        assert _replicas_seen(url) == set(ENGINES)


def _running(url: str) -> float:
    return sum(_engine_requests(url, name) for name in ENGINES)


def test_a_client_that_leaves_aborts_its_request_in_the_engine(
    engines_apart: RunningApp,
) -> None:
    url = engines_apart.base_url
    events = _stream_events(url, max_tokens=LONG_STREAM_TOKENS)
    assert next(events)["choices"]
    eventually(lambda: _running(url) == 1, 30, RECOVERY_POLL_S)
    events.close()  # the client goes away mid-stream
    eventually(lambda: _running(url) == 0, 30, RECOVERY_POLL_S)


def test_engines_killed_mid_stream_end_the_stream_with_an_error_and_rejoin(
    engines_apart: RunningApp,
) -> None:
    url = engines_apart.base_url
    engines = _replica_pids(ENGINES[0]) + _replica_pids(ENGINES[1])
    assert len(engines) == 2
    got_error = False
    for tokens, event in enumerate(_stream_events(url, max_tokens=LONG_STREAM_TOKENS)):
        if "error" in event:
            got_error = True
            break
        if tokens == 5:
            for pid in engines:  # whichever engine serves this stream
                os.kill(pid, signal.SIGKILL)
    assert got_error, "a stream cut after its first token must end with an error event"
    # Serve restarts the replicas; each router reconnects and uses both engines again.
    eventually(
        lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200,
        RECOVERY_TIMEOUT_S,
        RECOVERY_POLL_S,
    )
    assert not set(engines) & set(_replica_pids(ENGINES[0]) + _replica_pids(ENGINES[1]))
    for router_url in engines_apart.router_urls:
        assert _replicas_seen(router_url) == set(ENGINES)


def test_one_router_killed_the_other_serves_every_engine(engines_apart: RunningApp) -> None:
    routers = _replica_pids(ROUTER_DEPLOYMENT)
    assert len(routers) == ROUTERS
    os.kill(routers[0], signal.SIGKILL)
    answering = []
    for url in engines_apart.router_urls:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                answering.append(url)
        except httpx.HTTPError:
            pass
    assert answering, "the surviving router stopped answering"
    assert _replicas_seen(answering[0]) == set(ENGINES)
