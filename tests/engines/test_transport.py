"""The router<->engine transport, without Ray: a synthetic engine host served on the
loopback address, reached by the router's SocketEngineLink through an EngineClient."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from deployments.app import engine_names, engine_spec
from deployments.config import parse_app_config
from engines.protocol import EngineStats, GenerateChunk, GenerateRequest
from engines.synthetic import SyntheticEngineHost
from engines.transport import EngineTransportServer, TransportAddress, encode_frame
from router.pool.engine_client import (
    EngineClient,
    EngineFailed,
    EngineUnavailable,
    SocketEngineLink,
)

CONFIG = parse_app_config(
    {"strategy": "dp", "pools": [{"replicas": 2}], "engine": {"backend": "synthetic"}}
)
WAIT_S = 10


class _Remote:
    def __init__(self, value: Any) -> None:
        self._value = value

    async def remote(self) -> Any:
        return self._value


class FakeHandle:
    """What SocketEngineLink asks of an engine replica's Serve handle."""

    def __init__(self, address: TransportAddress) -> None:
        self.transport_address = _Remote(address)


def _request(request_id: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id, "", [7, 8, 9], SimpleNamespace(max_tokens=max_tokens))


@contextlib.asynccontextmanager
async def _served(
    step_interval_s: float = 0.0,
) -> AsyncIterator[tuple[SyntheticEngineHost, EngineTransportServer, EngineClient]]:
    name, pool, index = engine_names(CONFIG)[0]
    spec = engine_spec(CONFIG, name, pool, index)
    spec = spec.model_copy(
        update={"backend": spec.backend.model_copy(update={"step_interval_s": step_interval_s})}
    )
    host = SyntheticEngineHost(spec)
    server = EngineTransportServer(host)
    address = await server.start("127.0.0.1")
    client = EngineClient(name, "mixed", SocketEngineLink(FakeHandle(address)), 5.0)
    client.start()
    try:
        # As the router's readiness check does, beside the client's own listener: one
        # connection between them, or calls would travel on one that never said hello.
        await asyncio.wait_for(client.link.wait_ready(), WAIT_S)
        await asyncio.wait_for(_until(lambda: client.link.ready), WAIT_S)
        yield host, server, client
    finally:
        await client.stop()
        await server.stop()
        host.shutdown()


async def _until(condition: Any) -> None:
    while not condition():
        await asyncio.sleep(0.01)


async def test_tokens_stats_and_health_cross_the_connection() -> None:
    async with _served() as (_, _, client):
        chunks = [chunk async for chunk in client.generate(_request("a", 4))]
        stats = await client.link.stats()
        await client.link.check_health()
    assert [len(chunk.token_ids) for chunk in chunks] == [1, 1, 1, 1]
    assert chunks[-1].finish_reason == "length"
    assert isinstance(stats, EngineStats) and stats.replica == "engine-0"


async def test_many_requests_share_one_connection_and_each_gets_its_own_tokens() -> None:
    async def one(client: EngineClient, request_id: str, n: int) -> int:
        return sum([len(c.token_ids) async for c in client.generate(_request(request_id, n))])

    async with _served() as (_, _, client):
        counts = await asyncio.gather(*(one(client, f"r{i}", 3 + i) for i in range(20)))
    assert counts == [3 + i for i in range(20)]


async def test_a_submit_the_engine_refuses_fails_that_request_only() -> None:
    async with _served(step_interval_s=0.05) as (host, _, client):
        taken = _request("same", 10_000)
        taken.subscriber = "another-router"
        await host.submit(taken)
        with pytest.raises(EngineFailed, match="already running"):
            await anext(client.generate(_request("same", 5)))
        chunks = [chunk async for chunk in client.generate(_request("other", 2))]
    assert [chunk.finish_reason for chunk in chunks] == [None, "length"]


async def test_a_client_that_leaves_aborts_its_request_in_the_engine() -> None:
    async with _served(step_interval_s=0.01) as (host, _, client):
        stream = client.generate(_request("left", 10_000))
        await anext(stream)
        assert host.stats().num_running == 1
        await stream.aclose()
        await asyncio.wait_for(_until(lambda: host.stats().num_running == 0), WAIT_S)


async def test_an_engine_that_goes_away_fails_what_was_in_flight_as_unavailable() -> None:
    async with _served(step_interval_s=0.01) as (_, server, client):
        stream = client.generate(_request("cut", 10_000))
        await anext(stream)
        await server.stop()
        with pytest.raises(EngineUnavailable):
            async for _ in stream:
                pass
        assert not client.healthy


async def test_a_connection_without_the_secret_is_refused() -> None:
    host = SyntheticEngineHost(engine_spec(CONFIG, *engine_names(CONFIG)[0]))
    server = EngineTransportServer(host)
    address = await server.start("127.0.0.1")
    forged = TransportAddress(address.host, address.port, "not-the-secret")
    link = SocketEngineLink(FakeHandle(forged))
    await asyncio.wait_for(link.wait_ready(), WAIT_S)
    stream = link.deltas("router-x")
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(anext(stream), WAIT_S)
    assert not link.ready
    await server.stop()


def test_a_chunk_crosses_the_connection_with_every_field() -> None:
    """GenerateChunk pickles as its constructor's arguments: a field added to it and not
    to ``__reduce__`` would arrive with its default."""
    chunk = GenerateChunk(
        token_ids=[3, 4],
        text="tokens",
        finish_reason="stop",
        stop_reason=13,
        num_prompt_tokens=512,
        num_cached_tokens=256,
        kv_transfer_params={"remote_block_ids": [1, 2]},
    )
    arrived = pickle.loads(encode_frame(("deltas", [("request", chunk)]))[4:])
    assert arrived == ("deltas", [("request", chunk)])
    defaults = {name: field.default for name, field in GenerateChunk.__dataclass_fields__.items()}
    assert all(getattr(chunk, name) != default for name, default in defaults.items())
