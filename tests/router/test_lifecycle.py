"""One request's life (router/lifecycle.py) through the in-process router: however a
request ends, it is counted once with its status, its engines' in-flight counts are back
where they were, and its API key's queue slot is free again."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from engines.synthetic import SyntheticEngineHost
from tests.support.in_process_router import (
    CHAT,
    COMPLETIONS,
    PROMPT,
    http_client,
    in_process_router,
    metric,
    only_model,
    ready,
    until,
)

MODEL = "splitserve-tiny-llama"
KEY = "sk-lifecycle-test-key-0123456789"
AUTH = {"keys": [{"name": "team", "key": KEY, "max_queued": 1}]}
HEADERS = {"authorization": f"Bearer {KEY}"}
REQUESTS = "splitserve_requests_total"


def _in_flight(router: Any) -> dict[str, int]:
    return {engine.name: engine.state.in_flight for engine in only_model(router).pool}


def _waiting(router: Any) -> int:
    return router._auth.waiting("team")


async def _counted(client: httpx.AsyncClient, route: str, status: str) -> float:
    return await metric(client, REQUESTS, HEADERS, route=route, status=status)


async def _settled(router: Any) -> None:
    await until(lambda: set(_in_flight(router).values()) == {0} and _waiting(router) == 0)


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, **fields}


async def test_each_way_a_request_ends_is_counted_once_and_frees_what_it_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with in_process_router(auth=AUTH) as router, http_client(router) as client:
        await ready(client, 10)
        before = _in_flight(router)
        cases: list[tuple[str, Callable[[], Any], str]] = [
            ("whole", lambda: client.post(COMPLETIONS, json=_completion(), headers=HEADERS), "200"),
            (
                "stream",
                lambda: client.post(COMPLETIONS, json=_completion(stream=True), headers=HEADERS),
                "200",
            ),
            (
                "vllm-layer",  # logprobs: rendered by vLLM's serving layer
                lambda: client.post(CHAT, json=_chat(logprobs=True), headers=HEADERS),
                "200",
            ),
            (
                "bad",
                lambda: client.post(COMPLETIONS, json=_completion(max_tokens=0), headers=HEADERS),
                "400",
            ),
        ]
        for name, send, status in cases:
            route = CHAT if name == "vllm-layer" else COMPLETIONS
            counted = await _counted(client, route, status)
            response = await send()
            assert response.status_code == int(status), (name, response.text)
            await _settled(router)
            assert await _counted(client, route, status) == counted + 1, name
        assert _in_flight(router) == before

        # An engine that fails before the first token: a 500, and nothing held.
        monkeypatch.setattr(SyntheticEngineHost, "submit", _failing_submit)
        counted = await _counted(client, COMPLETIONS, "500")
        response = await client.post(COMPLETIONS, json=_completion(), headers=HEADERS)
        assert response.status_code == 500
        await _settled(router)
        assert await _counted(client, COMPLETIONS, "500") == counted + 1


async def test_a_client_that_leaves_mid_stream_ends_the_life_and_frees_the_engine() -> None:
    engine = {"backend": "synthetic", "step_interval_s": 0.05}
    async with in_process_router(engine=engine) as router, http_client(router) as client:
        await ready(client, 10)
        body = _completion(max_tokens=1000, stream=True, ignore_eos=True)
        task = asyncio.get_running_loop().create_task(client.post(COMPLETIONS, json=body))
        await until(lambda: max(_in_flight(router).values()) == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: set(_in_flight(router).values()) == {0})


async def test_two_requests_through_vllms_layer_at_once_each_say_where_they_ran() -> None:
    """vLLM's layer hands each request its own life (as an argument, not a context
    variable): two at once on two engines each report their own engine."""
    pools = [{"replicas": 2}]
    args: dict[str, Any] = {
        "shape": "dp",
        "pools": pools,
        "router": {"replica_choice": "round_robin"},
    }
    engine = {"backend": "synthetic", "step_interval_s": 0.05}
    async with in_process_router(engine=engine, **args) as router, http_client(router) as client:
        await ready(client, 10)
        body = _completion(n=2)  # n > 1: vLLM's layer
        first, second = await asyncio.gather(
            client.post(COMPLETIONS, json=body), client.post(COMPLETIONS, json=body)
        )
        assert first.status_code == second.status_code == 200
        engines = {first.headers["x-splitserve-replica"], second.headers["x-splitserve-replica"]}
        assert engines == {"engine-0", "engine-1"}
        await until(lambda: set(_in_flight(router).values()) == {0})


def _chat(**fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "hi"}]
    return {"model": MODEL, "messages": messages, "max_tokens": 3, **fields}


async def _failing_submit(host: Any, request: Any) -> None:
    raise RuntimeError("the engine failed")
