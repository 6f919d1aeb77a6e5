"""The synthetic engine host, alone: the same calls as a vLLM engine host, no model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from types import SimpleNamespace

from deployments.app import engine_names, engine_spec
from deployments.config import parse_app_config
from engines.protocol import EngineStats, GenerateRequest
from engines.synthetic import SyntheticEngineHost

CONFIG = parse_app_config(
    {"shape": "dp", "pools": [{"replicas": 2}], "engine": {"backend": "synthetic"}}
)


def _host() -> SyntheticEngineHost:
    name, pool, index = engine_names(CONFIG)[0]
    return SyntheticEngineHost(engine_spec(CONFIG, name, pool, index))


def _request(request_id: str, max_tokens: int, subscriber: str = "router-a") -> GenerateRequest:
    return GenerateRequest(
        request_id, subscriber, [7, 8, 9], SimpleNamespace(max_tokens=max_tokens)
    )


async def _collect(host: SyntheticEngineHost, subscriber: str, deltas: int) -> list:
    stream = host.deltas(subscriber)
    assert isinstance(stream, AsyncGenerator)  # so that it can be closed
    seen: list = []
    while len(seen) < deltas:
        seen.extend(await asyncio.wait_for(anext(stream), 5))
    await stream.aclose()
    return seen


def test_every_request_gets_its_tokens_and_a_finish_reason() -> None:
    async def scenario() -> list:
        host = _host()
        await host.submit(_request("a", 3))
        await host.submit(_request("b", 2))
        seen = await _collect(host, "router-a", 5)
        host.shutdown()
        return seen

    seen = asyncio.run(scenario())
    by_request: dict[str, list] = {}
    for request_id, chunk in seen:
        by_request.setdefault(request_id, []).append(chunk)
    assert {key: len(chunks) for key, chunks in by_request.items()} == {"a": 3, "b": 2}
    for chunks in by_request.values():
        assert [chunk.finish_reason for chunk in chunks][-1] == "length"
        assert all(chunk.finish_reason is None for chunk in chunks[:-1])
        assert all(chunk.num_prompt_tokens == 3 for chunk in chunks)


def test_a_subscriber_that_stops_reading_leaves_nothing_running() -> None:
    async def scenario() -> int:
        host = _host()
        await host.submit(_request("long", 10_000))
        await _collect(host, "router-a", 1)  # closes the stream after the first delta
        running = host.stats().num_running
        host.shutdown()
        return running

    assert asyncio.run(scenario()) == 0


def test_abort_stops_a_request_and_duplicates_are_refused() -> None:
    async def scenario() -> tuple[int, str]:
        host = _host()
        await host.submit(_request("x", 10_000))
        try:
            await host.submit(_request("x", 1))
            refused = ""
        except ValueError as error:
            refused = str(error)
        await host.abort("x")
        running = host.stats().num_running
        host.shutdown()
        return running, refused

    running, refused = asyncio.run(scenario())
    assert running == 0
    assert "already running" in refused


def test_a_capped_batch_serves_the_oldest_requests_and_the_rest_wait() -> None:
    config = parse_app_config(
        {
            "shape": "dp",
            "pools": [{"replicas": 2}],
            "engine": {"backend": "synthetic", "max_num_seqs": 1},
        }
    )

    async def scenario() -> tuple[list, EngineStats]:
        name, pool, index = engine_names(config)[0]
        host = SyntheticEngineHost(engine_spec(config, name, pool, index))
        await host.submit(_request("first", 2))
        await host.submit(_request("second", 2))
        stats = host.stats()
        seen = await _collect(host, "router-a", 4)
        host.shutdown()
        return seen, stats

    seen, stats = asyncio.run(scenario())
    assert [request_id for request_id, _ in seen] == ["first", "first", "second", "second"]
    assert (stats.num_running, stats.num_waiting) == (1, 1)
