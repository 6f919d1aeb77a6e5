"""The HTTP/1.1 transport under httpx: chunked bodies in any slicing, reuse, failures."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from loadgen.transport import PooledHTTP11Transport, _Connection, make_transport


def _chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
PARTS = [b"data: one\n\n", b"data: two\r\nwith crlf\n\n", b"x" * 300, b"data: [DONE]\n\n"]


async def _feed(pieces: list[bytes]) -> tuple[int, bytes, _Connection]:
    connection = _Connection()
    connection._head_waiter = asyncio.get_running_loop().create_future()
    for piece in pieces:
        connection.data_received(piece)
    head = await connection.response_head(1.0)
    body = b""
    while data := await connection.read_body(1.0):
        body += data
    return head.status, body, connection


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 10_000])
async def test_chunked_body_in_any_slicing(size: int) -> None:
    raw = HEAD + _chunked(PARTS)
    status, body, connection = await _feed([raw[i : i + size] for i in range(0, len(raw), size)])
    assert status == 200 and body == b"".join(PARTS)
    assert connection.body_done and connection.reusable


async def test_chunk_extensions_and_trailers() -> None:
    raw = HEAD + b"5;name=value\r\nhello\r\n0\r\nx-trailer: 1\r\n\r\n"
    _, body, connection = await _feed([raw])
    assert body == b"hello" and connection.reusable


async def test_content_length_and_connection_close() -> None:
    raw = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 5\r\nconnection: close\r\n\r\nbusy!"
    status, body, connection = await _feed([raw])
    assert (status, body) == (503, b"busy!")
    assert not connection.reusable


async def test_bad_chunk_size_is_a_protocol_error() -> None:
    connection = _Connection()
    connection._head_waiter = asyncio.get_running_loop().create_future()
    connection.transport = None
    connection.data_received(HEAD + b"zz\r\nhello\r\n")
    await connection.response_head(1.0)
    with pytest.raises(httpx.RemoteProtocolError, match="bad chunk size"):
        await connection.read_body(1.0)


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], object]


async def _server(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    return head + await reader.readexactly(length)


async def test_keep_alive_reuses_one_connection() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            try:
                request = await _read_request(reader)
            except asyncio.IncompleteReadError:
                break
            assert b"content-length: 5" in request.lower() and request.endswith(b"hello")
            writer.write(HEAD + _chunked([b"a", b"b"]))
            await writer.drain()
        writer.close()

    server, url = await _server(handler)
    async with server, httpx.AsyncClient(transport=PooledHTTP11Transport(4)) as client:
        for _ in range(5):
            async with client.stream("POST", f"{url}/v1/completions", content=b"hello") as response:
                assert [chunk async for chunk in response.aiter_raw()] in ([b"ab"], [b"a", b"b"])
        assert connections == 1


async def test_server_closing_mid_stream_is_an_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(HEAD + b"5\r\nhel")
        await writer.drain()
        writer.close()

    server, url = await _server(handler)
    async with server, httpx.AsyncClient(transport=PooledHTTP11Transport(2)) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("POST", f"{url}/x", content=b"{}") as response:
                async for _ in response.aiter_raw():
                    pass


async def test_read_timeout_and_refused_connection() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(0.6)  # longer than the client waits

    server, url = await _server(silent)
    async with server, httpx.AsyncClient(transport=PooledHTTP11Transport(2), timeout=0.2) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{url}/x", content=b"{}")
    server.close()
    async with httpx.AsyncClient(transport=PooledHTTP11Transport(2)) as client:
        with pytest.raises(httpx.ConnectError):
            await client.post(f"{url}/x", content=b"{}")


async def test_pool_limits_open_connections() -> None:
    open_now = peak = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_now, peak
        open_now += 1
        peak = max(peak, open_now)
        try:
            while True:
                await _read_request(reader)
                await asyncio.sleep(0.02)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            open_now -= 1
            writer.close()

    server, url = await _server(handler)
    async with server, httpx.AsyncClient(transport=PooledHTTP11Transport(3)) as client:
        responses = await asyncio.gather(
            *(client.post(f"{url}/x", content=b"{}") for _ in range(12))
        )
    assert all(r.text == "ok" for r in responses)
    assert peak == 3


def test_tls_urls_use_httpx_own_transport() -> None:
    assert isinstance(make_transport("http://127.0.0.1:8000", 4), PooledHTTP11Transport)
    assert isinstance(make_transport("https://example.invalid", 4), httpx.AsyncHTTPTransport)
