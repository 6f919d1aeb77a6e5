"""The router<->engine transport, without Ray: a synthetic engine host served on the
loopback address, reached by the router's SocketEngineLink through an PooledEngine, and
hostile peers on both ends: nothing is decoded before the secret is proved, frames are
bounded, and no frame is ever unpickled."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

from deployments.app import engine_names, engine_spec
from deployments.config import parse_app_config
from engines import transport
from engines.contract import EngineFailed, EngineUnavailable
from engines.protocol import (
    CONTINUE_FROM,
    CacheUpdate,
    DeltaBatch,
    EngineStats,
    GenerateChunk,
    GenerateFailure,
    GenerateRequest,
)
from engines.synthetic import SyntheticEngineHost
from engines.transport import (
    CHALLENGE_BYTES,
    DIGEST_BYTES,
    ENGINE_MESSAGES,
    MAGIC,
    MAX_FRAME_BYTES,
    ROUTER_MESSAGES,
    Call,
    Deltas,
    EngineTransportServer,
    Reply,
    SocketEngineLink,
    Subscribe,
    TransportAddress,
    TransportClosed,
    encode_frame,
    prove_to_engine,
    with_sampling_params,
)
from router.pool.pooled_engine import PooledEngine

CONFIG = parse_app_config(
    {"shape": "dp", "pools": [{"replicas": 2}], "engine": {"backend": "synthetic"}}
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
    return GenerateRequest(request_id, "", [7, 8, 9], SamplingParams(max_tokens=max_tokens))


@contextlib.asynccontextmanager
async def _served(
    step_interval_s: float = 0.0,
) -> AsyncIterator[tuple[SyntheticEngineHost, EngineTransportServer, PooledEngine]]:
    name, pool, index = engine_names(CONFIG)[0]
    spec = engine_spec(CONFIG, name, pool, index)
    spec = spec.model_copy(
        update={"backend": spec.backend.model_copy(update={"step_interval_s": step_interval_s})}
    )
    host = SyntheticEngineHost(spec)
    server = EngineTransportServer(host)
    address = await server.start("127.0.0.1")
    client = PooledEngine(name, "mixed", SocketEngineLink(FakeHandle(address)), 5.0)
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
    # A token a step; what waits unread arrives joined (router/pool/mailbox.py).
    assert sum(len(chunk.token_ids) for chunk in chunks) == 4
    assert chunks[-1].finish_reason == "length"
    assert isinstance(stats, EngineStats) and stats.replica == "engine-0"


async def test_many_requests_share_one_connection_and_each_gets_its_own_tokens() -> None:
    async def one(client: PooledEngine, request_id: str, n: int) -> int:
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


async def test_a_router_with_the_wrong_secret_never_connects() -> None:
    host = SyntheticEngineHost(engine_spec(CONFIG, *engine_names(CONFIG)[0]))
    server = EngineTransportServer(host)
    address = await server.start("127.0.0.1")
    forged = TransportAddress(address.host, address.port, "not-the-secret")
    link = SocketEngineLink(FakeHandle(forged))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(link.wait_ready(), 1.0)
    assert not link.ready and server.refused >= 1
    await server.stop()
    host.shutdown()


async def test_a_router_refuses_an_engine_that_cannot_prove_the_secret() -> None:
    """A stranger on a reused port greets as an engine but cannot answer the router's
    challenge: the router gives up on it before it sends a request."""

    async def stranger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(MAGIC + bytes(CHALLENGE_BYTES))
        await reader.readexactly(DIGEST_BYTES + CHALLENGE_BYTES)
        writer.write(bytes(DIGEST_BYTES))
        await writer.drain()
        await reader.read()

    server = await asyncio.start_server(stranger, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
    with pytest.raises(TransportClosed, match="did not prove"):
        await prove_to_engine(reader, writer, "the-secret")
    writer.close()
    server.close()


def test_every_message_crosses_with_every_field() -> None:
    """msgpack carries each protocol type field by field: every field set away from its
    default arrives as it was sent, and the union of deltas decodes to its own types."""
    chunk = GenerateChunk(
        token_ids=[3, 4],
        text="tokens",
        finish_reason="stop",
        stop_reason=13,
        num_prompt_tokens=512,
        num_cached_tokens=256,
        kv_transfer_params={"remote_block_ids": [1, 2]},
        index=1,
        logprobs=[[(3, -0.5, 1, "c"), (9, -1.5, 2, None)], [(4, float("-inf"), 7, "d")]],
        prompt_logprobs=[None, [(1, -2.0, 3, "a")]],
    )
    defaults = GenerateChunk([], "")
    assert all(getattr(chunk, f) != getattr(defaults, f) for f in GenerateChunk.__struct_fields__)
    batch: DeltaBatch = [
        ("request", chunk),
        ("", CacheUpdate(stored=[(b"\x01\x02", -5), (7, 9)], removed=[b"\x03"], cleared=True)),
        ("other", GenerateFailure("gone", engine_dead=True)),
    ]
    assert ENGINE_MESSAGES.decode(encode_frame(Deltas(batch))[4:]) == Deltas(batch)
    stats = EngineStats("engine-0", "decode", 1, 2, 3, 0.5, 6, 7, 8.0, 16, 99, {"a": 1}, "d0", 4096)
    assert ENGINE_MESSAGES.decode(encode_frame(Reply(4, None, stats))[4:]) == Reply(4, None, stats)


def test_sampling_parameters_arrive_as_vllms_own_type() -> None:
    params = SamplingParams(
        max_tokens=9,
        temperature=0.5,
        seed=3,
        stop=["x"],
        logit_bias={5: 1.5},
        logprobs=2,
        prompt_logprobs=1,
        n=2,
        extra_args={CONTINUE_FROM: [5]},
        structured_outputs=StructuredOutputsParams(regex="[0-9]{3}-[a-z]{4}"),
        output_kind=RequestOutputKind.DELTA,
    )
    request = GenerateRequest("r", "router-1", [1, 2], params, {"k": [1]}, priority=2)
    sent = ROUTER_MESSAGES.decode(encode_frame(Call(1, "submit", request))[4:])
    assert isinstance(sent, Call) and sent.argument is not None
    arrived = with_sampling_params(sent.argument)
    assert isinstance(arrived.sampling_params, SamplingParams)
    assert arrived.sampling_params == params and arrived == request


# What a stranger on the node's network might send to an engine's port.
class _Evil:
    """Unpickling this creates a file: the proof that a frame was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def _framed(body: bytes, length: int | None = None) -> bytes:
    return struct.pack("!I", len(body) if length is None else length) + body


async def _closed_by_engine(reader: asyncio.StreamReader) -> bool:
    """The engine closed the connection: reading ends, with nothing more, in time."""
    try:
        while await asyncio.wait_for(reader.read(4096), WAIT_S):
            pass
    except ConnectionError:
        pass
    return True


async def _hostile(address: TransportAddress, payload: bytes, authenticate: bool) -> None:
    reader, writer = await asyncio.open_connection(address.host, address.port)
    if authenticate:
        await prove_to_engine(reader, writer, address.secret)
    else:
        await reader.readexactly(len(MAGIC) + CHALLENGE_BYTES)
    writer.write(payload)
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    assert await _closed_by_engine(reader)
    writer.close()


@pytest.mark.parametrize("authenticate", [False, True], ids=["stranger", "with-the-secret"])
async def test_hostile_frames_run_nothing_close_the_connection_and_the_engine_serves_on(
    tmp_path: Path, authenticate: bool
) -> None:
    marker = tmp_path / "unpickled"
    subscribe = _framed(msgspec.msgpack.encode(Subscribe("x")))
    payloads = {
        "pickle": _framed(pickle.dumps(_Evil(marker))),
        # Past the handshake its first four bytes are a frame's length: one within the
        # bound (1 in 64 of random ones) is a frame the engine rightly waits to read.
        "garbage": b"\xff" + os.urandom(DIGEST_BYTES + CHALLENGE_BYTES + 63),
        "huge length": _framed(b"\x00" * 16, length=0xFFFFFFF0),
        "one byte over the bound": _framed(b"", length=MAX_FRAME_BYTES + 1),
        "not a message": _framed(msgspec.msgpack.encode(["call", 1, "exec", "rm -rf /"])),
        "a call before subscribing": _framed(msgspec.msgpack.encode(Call(1, "stats"))),
        "a pickle after subscribing": subscribe + _framed(pickle.dumps(_Evil(marker))),
    }
    async with _served(step_interval_s=0.001) as (_, server, client):
        assert server.address is not None
        for name, payload in payloads.items():
            await asyncio.wait_for(_hostile(server.address, payload, authenticate), WAIT_S * 2)
            assert not marker.exists(), f"{name}: a frame was unpickled"
        assert server.refused == len(payloads)
        chunks = [chunk async for chunk in client.generate(_request("after", 3))]
    assert sum(len(chunk.token_ids) for chunk in chunks) == 3  # the engine still serves


async def test_a_peer_that_says_nothing_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "HANDSHAKE_TIMEOUT_S", 0.2)
    async with _served() as (_, server, _client):
        assert server.address is not None
        reader, writer = await asyncio.open_connection(server.address.host, server.address.port)
        assert await _closed_by_engine(reader)
        writer.close()


async def test_a_router_that_leaves_is_not_counted_as_refused() -> None:
    async with _served() as (_, server, _client):
        assert server.address is not None
        link = SocketEngineLink(FakeHandle(server.address))
        await asyncio.wait_for(link.wait_ready(), WAIT_S)
        stream = link.deltas("router-leaving")
        reading = asyncio.ensure_future(anext(stream))
        await asyncio.wait_for(_until(lambda: link.ready), WAIT_S)
        await link.stats()
        link.shutdown()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(reading, WAIT_S)
        await asyncio.sleep(0.2)
        assert server.refused == 0
