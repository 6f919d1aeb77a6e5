"""The engine side of the router<->engine transport: one TCP connection per (router
process, engine replica), carrying calls one way and every request's deltas the other.

Ray carries only control: the router asks the engine replica's Serve handle for the
address and a per-replica secret once, then speaks to the engine directly. A Ray
streaming item per engine step cost DP 2.4x vllm-router's TTFT (docs/DECISIONS.md);
a socket costs a write per step and no Ray task per request, on one node and across
nodes alike.

Frames are a 4-byte big-endian length and a pickle. From the router:
``("hello", secret, subscriber)`` once, then ``("call", call_id, method, argument)``
(``submit``, ``stats``, ``check_health``) and ``("abort", request_id)``. From the
engine: ``("reply", call_id, error, value)`` and ``("deltas", DeltaBatch)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import pickle
import secrets
import struct
from dataclasses import dataclass
from typing import Any, Protocol

from engines.protocol import EngineStats, GenerateRequest

logger = logging.getLogger("splitserve.engine")
_LENGTH = struct.Struct("!I")
# The calls a router may make over a connection (EngineHost's methods of those names).
CALLS = ("submit", "stats", "check_health")


class TransportClosed(ConnectionError):
    """The other side closed the connection (or it broke)."""


def encode_frame(message: tuple[Any, ...]) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> tuple[Any, ...]:
    try:
        (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        return pickle.loads(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError) as error:
        raise TransportClosed(str(error) or "connection closed") from error


@dataclass(frozen=True, slots=True)
class TransportAddress:
    """Where a router reaches one engine replica, and the secret it must say first."""

    host: str
    port: int
    secret: str


class HostedEngine(Protocol):
    """What the transport serves: engines.host.EngineHost's calls."""

    async def submit(self, request: GenerateRequest) -> None: ...

    async def abort(self, request_id: str) -> None: ...

    def deltas(self, subscriber: str) -> Any: ...

    def stats(self) -> EngineStats: ...

    async def check_health(self) -> None: ...


class EngineTransportServer:
    """Serves one engine host to every router process that connects."""

    def __init__(self, host: HostedEngine) -> None:
        self._host = host
        self._secret = secrets.token_hex(16)
        self._servers: list[asyncio.Server] = []
        self._connections: set[asyncio.Task[None]] = set()
        self.address: TransportAddress | None = None

    async def start(self, node_ip: str) -> TransportAddress:
        """Listen on the node's address, where Ray's own workers listen, on a port the
        kernel picks. (Not also on loopback at the same port: that port may belong to
        another process there, and a router would then talk to a stranger.)"""
        server = await asyncio.start_server(self._accept, node_ip, 0)
        self._servers.append(server)
        port = server.sockets[0].getsockname()[1]
        self.address = TransportAddress(node_ip, port, self._secret)
        return self.address

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._connections):
            task.cancel()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._serve(reader, writer)
        except (TransportClosed, asyncio.CancelledError):
            pass
        except Exception:
            logger.exception("engine transport connection failed")
        finally:
            self._connections.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await read_frame(reader)
        if not (
            len(hello) == 3
            and hello[0] == "hello"
            and hmac.compare_digest(str(hello[1]), self._secret)
        ):
            logger.warning("engine transport: refused a connection without the secret")
            return
        subscriber = str(hello[2])
        sender = asyncio.get_running_loop().create_task(self._send_deltas(subscriber, writer))
        # The host ended the stream (it is being replaced): the router must reconnect.
        sender.add_done_callback(lambda _: writer.close())
        try:
            while not sender.done():
                message = await read_frame(reader)
                if message[0] == "abort":
                    await self._host.abort(message[1])
                elif message[0] == "call":
                    await self._call(writer, *message[1:])
        finally:
            # The router is gone: the host aborts what it had submitted (deltas' on_gone).
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sender

    async def _call(
        self, writer: asyncio.StreamWriter, call_id: int, method: str, argument: Any
    ) -> None:
        error: str | None = None
        value: Any = None
        try:
            if method not in CALLS:
                raise ValueError(f"unknown call {method!r}")
            result = getattr(self._host, method)(*(() if argument is None else (argument,)))
            value = await result if asyncio.iscoroutine(result) else result
        except Exception as failure:
            error = f"{type(failure).__name__}: {failure}"
        writer.write(encode_frame(("reply", call_id, error, value)))

    async def _send_deltas(self, subscriber: str, writer: asyncio.StreamWriter) -> None:
        stream = self._host.deltas(subscriber)
        try:
            async for batch in stream:
                writer.write(encode_frame(("deltas", batch)))
                await writer.drain()
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()
