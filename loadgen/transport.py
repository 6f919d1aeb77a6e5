"""A lean HTTP/1.1 connection pool for httpx, for plain ``http://`` load generation.

httpx's default transport (httpcore) costs more per request than a load generator can
afford: each request scans every pooled connection and polls each idle socket, and
each SSE chunk climbs through h11, httpcore, anyio and httpx. Measured on this
machine's loopback it topped out near 300 streamed requests/s at 64 connections,
a quarter of vLLM's aiohttp client. ``PooledHTTP11Transport`` keeps httpx's API
(``AsyncClient``, ``Request``, ``Response``, streaming, timeouts, exceptions) and
replaces only the wire: asyncio protocols, an O(1) idle-connection stack, and one
wake-up per network read however many chunks it carries.

It speaks HTTP/1.1 without TLS or proxies; anything else goes to httpx's own
transport (see ``make_transport``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

import httpx

MAX_HEAD_BYTES = 64 * 1024
CRLF = b"\r\n"
T = TypeVar("T")


class _BodyMode:
    LENGTH = "length"
    CHUNKED = "chunked"
    UNTIL_CLOSE = "until-close"
    NONE = "none"


@dataclass
class _Head:
    status: int
    headers: list[tuple[bytes, bytes]]
    keep_alive: bool


class _Connection(asyncio.Protocol):
    """One keep-alive connection: writes a request, parses one response at a time."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buffer = bytearray()
        self._head_waiter: asyncio.Future[_Head] | None = None
        self._head: _Head | None = None
        self._mode = _BodyMode.NONE
        self._remaining = 0  # bytes left: of the body (LENGTH) or of the current chunk
        self._chunk_state = "size"  # size -> data -> data-crlf -> ... -> trailers
        self._body: list[bytes] = []
        self._body_waiter: asyncio.Future[None] | None = None
        self.body_done = False
        self._error: Exception | None = None

    # ---- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._head is None or not self.body_done:
            if self._mode == _BodyMode.UNTIL_CLOSE and self._head is not None:
                self.body_done = True
            else:
                self._fail(httpx.RemoteProtocolError("server closed the connection mid-response"))
        self._wake()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        try:
            if self._head is None:
                self._parse_head()
            if self._head is not None and not self.body_done:
                self._parse_body()
        except httpx.RemoteProtocolError as error:
            self._fail(error)
            self.close()
        self._wake()

    # ---- request / response ------------------------------------------------------------

    def start(self, head: bytes, body: bytes) -> None:
        self._head = None
        self._head_waiter = self._loop.create_future()
        self._body.clear()
        self.body_done = False
        self._error = None
        assert self.transport is not None
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)

    async def response_head(self, timeout: float | None) -> _Head:
        assert self._head_waiter is not None
        if self._head is not None:
            return self._head
        if self._error is not None:
            raise self._error
        return await _wait(self._head_waiter, timeout, httpx.ReadTimeout)

    async def read_body(self, timeout: float | None) -> bytes:
        """Whatever body bytes have arrived (one or more network reads); b'' at the end."""
        while not self._body:
            if self._error is not None:
                raise self._error
            if self.body_done:
                return b""
            self._body_waiter = self._loop.create_future()
            await _wait(self._body_waiter, timeout, httpx.ReadTimeout)
        data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        return data

    @property
    def reusable(self) -> bool:
        return (
            not self.closed
            and self.body_done
            and self._error is None
            and self._head is not None
            and self._head.keep_alive
            and not self._buffer
        )

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    # ---- parsing ------------------------------------------------------------------------

    def _parse_head(self) -> None:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise httpx.RemoteProtocolError("response head too large")
            return
        lines = bytes(self._buffer[:end]).split(CRLF)
        del self._buffer[: end + 4]
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise httpx.RemoteProtocolError(f"bad status line {lines[0][:80]!r}")
        status = int(parts[1])
        headers = []
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers.append((name.strip(), value.strip()))
        self._set_body_mode(status, headers, parts[0])
        if 100 <= status < 200:
            return self._parse_head()  # interim response: the real one follows
        head = self._head
        assert head is not None and self._head_waiter is not None
        if not self._head_waiter.done():
            self._head_waiter.set_result(head)
        return None

    def _set_body_mode(
        self, status: int, headers: list[tuple[bytes, bytes]], version: bytes
    ) -> None:
        lowered = {name.lower(): value.lower() for name, value in headers}
        connection = lowered.get(b"connection", b"")
        keep_alive = b"close" not in connection and (
            version == b"HTTP/1.1" or b"keep-alive" in connection
        )
        if status in (204, 304) or 100 <= status < 200:
            self._mode = _BodyMode.NONE
        elif b"chunked" in lowered.get(b"transfer-encoding", b""):
            self._mode = _BodyMode.CHUNKED
            self._chunk_state = "size"
        elif b"content-length" in lowered:
            self._mode = _BodyMode.LENGTH
            self._remaining = int(lowered[b"content-length"])
        else:
            self._mode = _BodyMode.UNTIL_CLOSE
            keep_alive = False
        if 100 <= status < 200:
            return
        self._head = _Head(status, headers, keep_alive)
        self.body_done = self._mode == _BodyMode.NONE or (
            self._mode == _BodyMode.LENGTH and self._remaining == 0
        )

    def _parse_body(self) -> None:
        if self._mode == _BodyMode.CHUNKED:
            self._parse_chunked()
        elif self._mode == _BodyMode.LENGTH:
            take = min(self._remaining, len(self._buffer))
            if take:
                self._body.append(bytes(self._buffer[:take]))
                del self._buffer[:take]
                self._remaining -= take
            self.body_done = self._remaining == 0
        elif self._mode == _BodyMode.UNTIL_CLOSE and self._buffer:
            self._body.append(bytes(self._buffer))
            self._buffer.clear()

    def _parse_chunked(self) -> None:
        position, parts = _dechunk_whole(self._buffer) if self._chunk_state == "size" else (0, [])
        buffer = self._buffer
        size = len(buffer)
        while position < size:
            if self._chunk_state == "size":
                end = buffer.find(CRLF, position)
                if end < 0:
                    break
                self._remaining = _chunk_size(buffer[position:end])
                position = end + 2
                self._chunk_state = "data" if self._remaining else "trailers"
            elif self._chunk_state == "data":
                take = min(self._remaining, size - position)
                parts.append(bytes(buffer[position : position + take]))
                position += take
                self._remaining -= take
                if self._remaining == 0:
                    self._chunk_state = "data-crlf"
            elif self._chunk_state == "data-crlf":
                if size - position < 2:
                    break
                position += 2
                self._chunk_state = "size"
            else:  # trailers: header lines until an empty one
                end = buffer.find(CRLF, position)
                if end < 0:
                    break
                blank = end == position
                position = end + 2
                if blank:
                    self.body_done = True
                    break
        del buffer[:position]
        if parts:
            self._body.append(parts[0] if len(parts) == 1 else b"".join(parts))

    # ---- waking the reader --------------------------------------------------------------

    def _fail(self, error: Exception) -> None:
        if self._error is None and not (self.body_done and self._head is not None):
            self._error = error
        if self._head_waiter is not None and not self._head_waiter.done():
            self._head_waiter.set_exception(error)
            self._head_waiter.exception()  # mark retrieved: the reader may be gone

    def _wake(self) -> None:
        waiter = self._body_waiter
        if (
            waiter is not None
            and not waiter.done()
            and (self._body or self.body_done or self._error)
        ):
            waiter.set_result(None)
            self._body_waiter = None


async def _wait(future: asyncio.Future[T], timeout: float | None, error: type[Exception]) -> T:
    if timeout is None:
        return await future
    loop = asyncio.get_running_loop()
    handle = loop.call_later(timeout, _expire, future, error)
    try:
        return await future
    finally:
        handle.cancel()


def _dechunk_whole(buffer: bytearray) -> tuple[int, list[bytes]]:
    """The complete chunks at the start of ``buffer``, found with one C-level split.

    Streams usually arrive as whole chunks, many per read; splitting on CRLF and
    checking every size against its data is several times cheaper than walking the
    chunks one by one. It stops at the first chunk that does not check out (a partial
    chunk, data containing CRLF, extensions, the last chunk) and leaves it to the
    byte-by-byte parser.
    """
    pieces = bytes(buffer).split(CRLF)
    parts: list[bytes] = []
    position = 0
    index = 0
    while index + 2 < len(pieces):
        size_line, data = pieces[index], pieces[index + 1]
        try:
            size = int(size_line, 16)
        except ValueError:
            break
        if size == 0 or size != len(data):
            break
        parts.append(data)
        position += len(size_line) + size + 4
        index += 2
    return position, parts


def _chunk_size(line: bytearray) -> int:
    text = bytes(line).split(b";", 1)[0].strip()
    try:
        return int(text, 16)
    except ValueError:
        raise httpx.RemoteProtocolError(f"bad chunk size {text[:20]!r}") from None


def _expire(future: asyncio.Future[object], error: type[Exception]) -> None:
    if not future.done():
        future.set_exception(error("timed out waiting for the server"))


class _ResponseStream(httpx.AsyncByteStream):
    """The response body as httpx reads it; returns the connection to the pool at the end."""

    def __init__(self, pool: _OriginPool, connection: _Connection, timeout: float | None) -> None:
        self._pool = pool
        self._connection = connection
        self._timeout = timeout
        self._released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while data := await self._connection.read_body(self._timeout):
            yield data

    async def aclose(self) -> None:
        if not self._released:
            self._released = True
            self._pool.release(self._connection)


class _OriginPool:
    """Connections to one host:port; at most ``size`` open, idle ones reused last-in first."""

    def __init__(self, host: str, port: int, size: int) -> None:
        self._host = host
        self._port = port
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(size)

    async def acquire(
        self, connect_timeout: float | None, pool_timeout: float | None
    ) -> _Connection:
        if self._slots.locked():
            try:
                await asyncio.wait_for(self._slots.acquire(), pool_timeout)
            except TimeoutError:
                raise httpx.PoolTimeout("no free connection in the pool") from None
        else:
            await self._slots.acquire()  # free slot: no wait_for task on the hot path
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                return connection
        try:
            return await self._connect(connect_timeout)
        except BaseException:
            self._slots.release()
            raise

    async def _connect(self, timeout: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(_Connection, self._host, self._port), timeout
            )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {self._host}:{self._port}") from None
        except OSError as error:
            raise httpx.ConnectError(f"{self._host}:{self._port}: {error}") from error
        return protocol

    def release(self, connection: _Connection) -> None:
        if connection.reusable:
            self._idle.append(connection)
        else:
            connection.close()
        self._slots.release()

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()


class PooledHTTP11Transport(httpx.AsyncBaseTransport):
    """httpx transport: plain HTTP/1.1 keep-alive, up to ``max_connections`` per origin."""

    def __init__(self, max_connections: int) -> None:
        self._max_connections = max_connections
        self._pools: dict[tuple[str, int], _OriginPool] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"{type(self).__name__} speaks plain http only")
        port = url.port or 80
        pool = self._pools.get((url.host, port))
        if pool is None:
            pool = self._pools[(url.host, port)] = _OriginPool(
                url.host, port, self._max_connections
            )
        timeouts = request.extensions.get("timeout", {})
        connection = await pool.acquire(timeouts.get("connect"), timeouts.get("pool"))
        try:
            body = await request.aread()
            connection.start(_request_head(request, len(body)), body)
            head = await connection.response_head(timeouts.get("read"))
        except BaseException:
            connection.close()
            pool.release(connection)
            raise
        return httpx.Response(
            head.status,
            headers=head.headers,
            stream=_ResponseStream(pool, connection, timeouts.get("read")),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _request_head(request: httpx.Request, body_length: int) -> bytes:
    target = request.url.raw_path
    lines = [b"%s %s HTTP/1.1" % (request.method.encode(), target)]
    has_length = False
    for name, value in request.headers.raw:
        lowered = name.lower()
        if lowered == b"transfer-encoding":
            continue  # the body is sent whole, with a content-length
        has_length = has_length or lowered == b"content-length"
        lines.append(name + b": " + value)
    if not has_length and (body_length or request.method in ("POST", "PUT", "PATCH")):
        lines.append(b"content-length: %d" % body_length)
    return CRLF.join(lines) + b"\r\n\r\n"


def make_transport(base_url: str, max_connections: int) -> httpx.AsyncBaseTransport:
    """Our pool for plain http; httpx's own (TLS, proxies, HTTP/2) for anything else."""
    if httpx.URL(base_url).scheme == "http":
        return PooledHTTP11Transport(max_connections)
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections
    )
    return httpx.AsyncHTTPTransport(limits=limits)
