"""Several engines in one process (``pools[].engines_per_process``), behind two routers.

Four synthetic engines, two to a Serve replica, and two router replicas that both reach
every engine over its own transport: what a 64-engine simulated fleet does on one box
(bench/sim_fleet.py), at a size a test can start. The ``groups`` model of the model-free
served tests' shared application (tests/support/shared_apps.py).
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
import pytest

from deployments.launcher import APP_NAME, RunningApp
from loadgen.client.server_view import parse_metrics
from splitserve.processes import command_lines
from tests.support.shared_apps import SYNTHETIC_ROUTERS, synthetic_models

pytestmark = pytest.mark.serving

GROUPS = synthetic_models(Path())["groups"]
ENGINES, PER_PROCESS, ROUTERS = 4, 2, SYNTHETIC_ROUTERS
REPLICA_REQUESTS = "splitserve_replica_requests_total"


@pytest.fixture(scope="module")
def grouped(model_free_app: RunningApp) -> RunningApp:
    return model_free_app


def _complete(url: str) -> httpx.Response:
    body = {"model": GROUPS.name, "prompt": "hi", "max_tokens": 5}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


def _requests_by_engine(url: str) -> dict[str, float]:
    samples = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
    series = samples.get(REPLICA_REQUESTS, [])
    return {labels["replica"]: value for labels, value in series if labels["model"] == GROUPS.name}


def test_every_router_reaches_every_engine_of_a_shared_process(grouped: RunningApp) -> None:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        urls = [url for url in grouped.router_urls for _ in range(4 * ENGINES)]
        responses = list(pool.map(_complete, urls))
    assert [r.status_code for r in responses] == [200] * len(urls), responses[0].text
    assert all(r.json()["usage"]["completion_tokens"] == 5 for r in responses)
    engines = {GROUPS.engine("mixed", index) for index in range(ENGINES)}
    for url in grouped.router_urls:
        sent = _requests_by_engine(url)
        assert {name for name, count in sent.items() if count > 0} == engines, sent


def test_the_engines_share_processes_as_configured(grouped: RunningApp) -> None:
    prefix = f"ray::ServeReplica:{APP_NAME}:{GROUPS.group_prefix}"
    processes = [line for line in command_lines().values() if line.startswith(prefix)]
    assert len(processes) == ENGINES // PER_PROCESS, processes
