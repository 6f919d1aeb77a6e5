"""Several engines in one process (``pools[].engines_per_process``), behind two routers.

Four synthetic engines, two to a Serve replica, and two router replicas that both reach
every engine over its own transport: what a 64-engine simulated fleet does on one box
(bench/sim_fleet.py), at a size a test can start.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import httpx
import pytest

from deployments.launcher import APP_NAME, RunningApp
from engines.tiny_model import EMBEDDED_MODEL_NAME
from loadgen.client.server_view import parse_metrics
from splitserve.processes import command_lines
from tests.support.synthetic_apps import synthetic_dp

pytestmark = pytest.mark.serving

ENGINES, PER_PROCESS, ROUTERS = 4, 2, 2
REPLICA_REQUESTS = "splitserve_replica_requests_total"


@pytest.fixture(scope="module")
def grouped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningApp]:
    folder = tmp_path_factory.mktemp("groups")
    pool = {"role": "mixed", "replicas": ENGINES, "engines_per_process": PER_PROCESS}
    router = {"engine_in_router": False}
    with synthetic_dp(folder, ROUTERS, {"backend": "synthetic"}, router, pool) as app:
        yield app


def _complete(url: str) -> httpx.Response:
    body = {"model": EMBEDDED_MODEL_NAME, "prompt": "hi", "max_tokens": 5}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


def _requests_by_engine(url: str) -> dict[str, float]:
    samples = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
    return {labels["replica"]: value for labels, value in samples.get(REPLICA_REQUESTS, [])}


def test_every_router_reaches_every_engine_of_a_shared_process(grouped: RunningApp) -> None:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        urls = [url for url in grouped.router_urls for _ in range(4 * ENGINES)]
        responses = list(pool.map(_complete, urls))
    assert [r.status_code for r in responses] == [200] * len(urls), responses[0].text
    assert all(r.json()["usage"]["completion_tokens"] == 5 for r in responses)
    engines = {f"engine-{index}" for index in range(ENGINES)}
    for url in grouped.router_urls:
        sent = _requests_by_engine(url)
        assert {name for name, count in sent.items() if count > 0} == engines, sent


def test_the_engines_share_processes_as_configured(grouped: RunningApp) -> None:
    prefix = f"ray::ServeReplica:{APP_NAME}:engine-group-"
    processes = [line for line in command_lines().values() if line.startswith(prefix)]
    assert len(processes) == ENGINES // PER_PROCESS, processes
