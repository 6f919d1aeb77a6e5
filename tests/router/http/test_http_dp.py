"""DP over HTTP, in this process: synthetic engines behind one router (shape dp),
each replica choice observable in ``x-splitserve-replica``, and what a client sees
when an engine dies: a request is tried once more on another replica before its first
byte, the other engines keep serving, and the dead one is restarted in the router's
process (tests/support/in_process_router.py; no Ray cluster, no vLLM engine).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import pytest

from engines.protocol import EngineStats
from engines.synthetic import SyntheticEngineHost
from engines.tiny_model import EMBEDDED_MODEL_NAME
from tests.support.in_process_router import (
    COMPLETIONS,
    REPLICA,
    http_client,
    in_process_router,
    kill_engine,
    metric,
    only_model,
    openai_error,
    ready,
    sse_events,
    until,
)


def completion(prompt: list[int] | None = None, **fields: Any) -> dict[str, Any]:
    return {"model": EMBEDDED_MODEL_NAME, "prompt": prompt or [5, 6, 7], "max_tokens": 1, **fields}


@asynccontextmanager
async def dp(replicas: int = 2, **args: Any) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """A ready DP router over ``replicas`` synthetic engines, and an HTTP client of it."""
    args = {"shape": "dp", "pools": [{"replicas": replicas}], **args}
    async with in_process_router(**args) as router, http_client(router) as client:
        await ready(client)
        yield router, client


async def replicas_of(client: httpx.AsyncClient, prompts: list[list[int]]) -> list[str]:
    """The replica that served each prompt, one request after another."""
    served = []
    for prompt in prompts:
        response = await client.post(COMPLETIONS, json=completion(prompt))
        assert response.status_code == 200
        served.append(response.headers[REPLICA])
    return served


# ---- replica choice -------------------------------------------------------------------------


async def test_round_robin_takes_the_replicas_in_turn() -> None:
    async with dp() as (_, client):
        assert await replicas_of(client, [[1]] * 4) == ["engine-0", "engine-1"] * 2
        choices = "splitserve_replica_choices_total"
        assert await metric(client, choices, policy="round_robin", replica="engine-1") == 2


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("round_robin", ["engine-1", "engine-0", "engine-1"]),
        ("least_loaded", ["engine-1", "engine-1", "engine-1"]),
    ],
)
async def test_a_busy_replica_is_passed_over_by_least_loaded_only(
    policy: str, expected: list[str]
) -> None:
    args: dict[str, Any] = {
        "engine": {"backend": "synthetic", "step_interval_s": 0.02},
        "router": {"replica_choice": policy},
    }
    async with dp(**args) as (router, client):
        engine_0 = only_model(router).pool.get("engine-0")
        busy = asyncio.create_task(client.post(COMPLETIONS, json=completion(max_tokens=500)))
        await until(lambda: engine_0.state.in_flight == 1)
        assert await replicas_of(client, [[1]] * 3) == expected
        assert engine_0.state.in_flight == 1  # busy throughout (500 steps: 10 s)
        busy.cancel()  # the client leaves
        await asyncio.gather(busy, return_exceptions=True)
        await until(lambda: engine_0.state.in_flight == 0)


@pytest.fixture
def reported_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Synthetic engines report a KV cache's shape, as vLLM's do, so that the router
    mirrors their prefix caches."""
    report = SyntheticEngineHost.stats

    def stats(host: SyntheticEngineHost) -> EngineStats:
        return msgspec.structs.replace(report(host), block_size=16, kv_capacity_blocks=1024)

    monkeypatch.setattr(SyntheticEngineHost, "stats", stats)


async def test_prefix_affinity_keeps_a_prompt_on_the_replica_that_cached_it(
    reported_cache: None,
) -> None:
    first, second = list(range(1, 41)), list(range(101, 141))  # two full blocks each
    args: dict[str, Any] = {
        "router": {"replica_choice": "prefix_affinity", "stats_interval_s": 0.02}
    }
    async with dp(**args) as (router, client):
        await until(
            lambda: all(replica.state.prefix is not None for replica in only_model(router).pool)
        )
        served = await replicas_of(client, [first, first, second, second, first])
        assert served == ["engine-0", "engine-0", "engine-1", "engine-1", "engine-0"]
        choices = "splitserve_replica_choices_total"
        assert await metric(client, choices, reason="prefix_hit") == 3
        assert await metric(client, choices, reason="no_prefix_hit") == 2


# ---- a dead engine ----------------------------------------------------------------------------


async def test_a_request_whose_replica_died_is_retried_once_on_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with dp() as (router, client):
        kill_engine(router, "engine-0", monkeypatch)  # round robin's next
        response = await client.post(COMPLETIONS, json=completion(max_tokens=2, stream=True))
        assert response.status_code == 200 and response.headers[REPLICA] == "engine-1"
        assert [event["choices"][0]["text"] for event in sse_events(response)] == ["a", "a"]
        sent = "splitserve_replica_requests_total"
        assert await metric(client, sent, replica="engine-0") == 1
        assert await metric(client, sent, replica="engine-1") == 1


async def test_with_every_replica_dead_a_request_is_tried_twice_then_a_503(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with dp(replicas=3) as (router, client):
        for name in ("engine-0", "engine-1", "engine-2"):
            kill_engine(router, name, monkeypatch)
        response = await client.post(COMPLETIONS, json=completion())
        message = openai_error(response, 503, "ServiceUnavailableError", None)
        # Round robin's first choice, then the retry's other replica: both named, in order.
        tried = re.match(
            r"the engine replica is unavailable \(engine-0 then (engine-\d)\)", message
        )
        assert tried and tried[1] != "engine-0", message
        assert response.headers["retry-after"] == "5"  # router.submit_timeout_s
        assert await metric(client, "splitserve_replica_requests_total") == 2


async def test_a_dead_engine_leaves_the_other_serving_until_it_is_restarted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with dp() as (router, client):
        kill_engine(router, "engine-0", monkeypatch)
        assert await replicas_of(client, [[1]] * 4) == ["engine-1"] * 4
        health = await client.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "degraded"
        assert health.json()["replicas"] == {"engine-0": "starting", "engine-1": "ok"}
        # A new engine starts in the router's process (after LocalEngineLink's grace).
        await ready(client, timeout_s=10)
        await until(lambda: all(replica.healthy for replica in only_model(router).pool))
        assert set(await replicas_of(client, [[1]] * 2)) == {"engine-0", "engine-1"}
