"""The router<->engine transport, both halves: one TCP connection per (router process,
engine replica), carrying calls one way and every request's deltas the other. The
engine replica serves its ``EngineBackend`` with ``EngineTransportServer``; a router
reaches it through ``SocketEngineLink`` (an ``EngineLink``, engines/contract.py).

Ray carries only control: the router asks the engine replica's Serve handle for the
address and a per-replica secret once, then speaks to the engine directly. A Ray
streaming item per engine step cost DP 2.4x vllm-router's TTFT (docs/DECISIONS.md);
a socket costs a write per step and no Ray task per request, on one node and across
nodes alike.

The port listens on the node's address, so anything that reaches the node may connect.
Nothing it sends is decoded before it has proved the secret:

1. The engine sends ``MAGIC`` and a random challenge (fixed sizes).
2. The router answers HMAC-SHA256(secret, "router" + challenge) and a challenge of its
   own; the engine closes the connection unless the digest matches, within
   ``HANDSHAKE_TIMEOUT_S``.
3. The engine answers HMAC-SHA256(secret, "engine" + the router's challenge), so the
   router knows it reached the engine it was told of, not a stranger on a reused port.

Then frames: a 4-byte big-endian length, at most ``MAX_FRAME_BYTES``, and a msgpack
body decoded into the message types below and nothing else (data only, as vLLM's own
engine sockets carry msgpack, never a pickle). A frame that breaks any rule closes the
connection. From the router: ``Subscribe`` once, then ``Call`` (``submit``, ``stats``,
``check_health``, ``add_lora``, ``remove_lora``) and ``Abort``. From the engine:
``Reply`` and ``Deltas``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import logging
import secrets
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from engines.contract import EngineBackend, EngineFailed, EngineUnavailable
from engines.protocol import (
    CacheUpdate,
    DeltaBatch,
    EngineStats,
    GenerateChunk,
    GenerateFailure,
    GenerateRequest,
    LoraAdapter,
)

logger = logging.getLogger("splitserve.engine")
link_logger = logging.getLogger("splitserve.router")
_LENGTH = struct.Struct("!I")
# Names the protocol and its version: a peer speaking anything else fails at once.
MAGIC = b"SPLTSRV2"
CHALLENGE_BYTES = 32
DIGEST_BYTES = hashlib.sha256().digest_size
# An honest router answers the challenge in one round trip; a peer that does not is
# cut off rather than allowed to hold a connection open.
HANDSHAKE_TIMEOUT_S = 5.0
# The largest frame either side sends or reads. The largest honest frames are a submit
# with a whole prompt (a million token ids is about 5 MB of msgpack) and a non-streamed
# answer; 64 MiB is far above both, and far below what a hostile length prefix could
# make a reader allocate.
MAX_FRAME_BYTES = 64 * 1024 * 1024
# The calls a router may make over a connection (EngineHost's methods of those names).
CALLS = ("submit", "stats", "check_health", "add_lora", "remove_lora")


class TransportClosed(ConnectionError):
    """The other side closed the connection, or it broke."""


class ProtocolViolation(TransportClosed):
    """The peer did not prove the secret or sent what the protocol does not allow."""


class Subscribe(msgspec.Struct, array_like=True, tag="subscribe"):
    """A router process's first frame: send me the deltas of my requests."""

    subscriber: str


class Call(msgspec.Struct, array_like=True, tag="call"):
    call_id: int
    method: str
    argument: GenerateRequest | None = None
    adapter: LoraAdapter | None = None  # add_lora's and remove_lora's


class Abort(msgspec.Struct, array_like=True, tag="abort"):
    request_id: str


class Reply(msgspec.Struct, array_like=True, tag="reply"):
    call_id: int
    error: str | None = None
    value: EngineStats | None = None


class Deltas(msgspec.Struct, array_like=True, tag="deltas"):
    """Every (request id, delta) ready since the last batch (engines.protocol.DeltaBatch)."""

    batch: list[tuple[str, GenerateChunk | GenerateFailure | CacheUpdate]]


RouterMessage = Subscribe | Call | Abort
EngineMessage = Reply | Deltas
_encoder = msgspec.msgpack.Encoder()
ROUTER_MESSAGES = msgspec.msgpack.Decoder(RouterMessage)
ENGINE_MESSAGES = msgspec.msgpack.Decoder(EngineMessage)


def encode_frame(message: RouterMessage | EngineMessage) -> bytes:
    body = _encoder.encode(message)
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"a {len(body)}-byte frame is over the transport's {MAX_FRAME_BYTES}")
    return _LENGTH.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, decoder: msgspec.msgpack.Decoder) -> Any:
    """The next message, decoded by ``decoder`` (ROUTER_MESSAGES or ENGINE_MESSAGES)."""
    (length,) = _LENGTH.unpack(await _read(reader, _LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise ProtocolViolation(f"a {length}-byte frame is over {MAX_FRAME_BYTES}")
    try:
        return decoder.decode(await _read(reader, length))
    except msgspec.DecodeError as error:  # ValidationError is a DecodeError
        raise ProtocolViolation(f"not a message of the transport: {error}") from error


async def _read(reader: asyncio.StreamReader, size: int) -> bytes:
    try:
        return await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError) as error:
        raise TransportClosed(f"connection closed: {error}") from error


def with_sampling_params(request: GenerateRequest) -> GenerateRequest:
    """``request`` with its sampling parameters as vLLM's type: they cross as msgpack
    data, and only the engine's process, which has vLLM loaded, needs their class."""
    from vllm.sampling_params import SamplingParams

    request.sampling_params = msgspec.convert(request.sampling_params, SamplingParams)
    return request


def _digest(secret: str, side: bytes, challenge: bytes) -> bytes:
    return hmac.new(secret.encode(), side + challenge, hashlib.sha256).digest()


async def _read_exactly(reader: asyncio.StreamReader, size: int) -> bytes:
    try:
        return await asyncio.wait_for(reader.readexactly(size), HANDSHAKE_TIMEOUT_S)
    except (asyncio.IncompleteReadError, ConnectionError, TimeoutError) as error:
        raise ProtocolViolation(f"handshake not completed: {error!r}") from error


async def prove_to_engine(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: str
) -> None:
    """The router's half of the handshake; TransportClosed if the engine is not the one
    that holds ``secret``."""
    greeting = await _read_exactly(reader, len(MAGIC) + CHALLENGE_BYTES)
    if greeting[: len(MAGIC)] != MAGIC:
        raise ProtocolViolation("the peer does not speak the engine transport")
    challenge = secrets.token_bytes(CHALLENGE_BYTES)
    writer.write(_digest(secret, b"router", greeting[len(MAGIC) :]) + challenge)
    answer = await _read_exactly(reader, DIGEST_BYTES)
    if not hmac.compare_digest(answer, _digest(secret, b"engine", challenge)):
        raise ProtocolViolation("the engine did not prove the replica's secret")


async def check_router(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: str
) -> None:
    """The engine's half: TransportClosed unless the peer proves ``secret``."""
    challenge = secrets.token_bytes(CHALLENGE_BYTES)
    writer.write(MAGIC + challenge)
    answer = await _read_exactly(reader, DIGEST_BYTES + CHALLENGE_BYTES)
    if not hmac.compare_digest(answer[:DIGEST_BYTES], _digest(secret, b"router", challenge)):
        raise ProtocolViolation("the peer did not prove the replica's secret")
    writer.write(_digest(secret, b"engine", answer[DIGEST_BYTES:]))


@dataclass(frozen=True, slots=True)
class TransportAddress:
    """Where a router reaches one engine replica, and the secret it must prove."""

    host: str
    port: int
    secret: str


class EngineTransportServer:
    """Serves one engine host to every router process that connects."""

    def __init__(self, host: EngineBackend) -> None:
        self._host = host
        self._secret = secrets.token_hex(32)
        self._servers: list[asyncio.Server] = []
        self._connections: set[asyncio.Task[None]] = set()
        self.address: TransportAddress | None = None
        # Connections closed for breaking the protocol, for tests and logs.
        self.refused = 0

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
            await check_router(reader, writer, self._secret)
            await self._serve(reader, writer)
        except ProtocolViolation as error:
            self.refused += 1
            logger.warning("engine transport: closed a connection: %s", error)
        except (TransportClosed, asyncio.CancelledError):
            pass  # the router left
        except Exception:
            logger.exception("engine transport connection failed")
        finally:
            self._connections.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await read_frame(reader, ROUTER_MESSAGES)
        if not isinstance(hello, Subscribe):
            raise ProtocolViolation(f"expected a subscribe frame first, got {type(hello).__name__}")
        sender = asyncio.get_running_loop().create_task(self._send_deltas(hello.subscriber, writer))
        # The host ended the stream (it is being replaced): the router must reconnect.
        sender.add_done_callback(lambda _: writer.close())
        try:
            while not sender.done():
                message = await read_frame(reader, ROUTER_MESSAGES)
                if isinstance(message, Abort):
                    await self._host.abort(message.request_id)
                elif isinstance(message, Call):
                    await self._call(writer, message)
                else:
                    raise ProtocolViolation("a second subscribe frame")
        finally:
            # The router is gone: the host aborts what it had submitted (deltas' on_gone).
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sender

    async def _call(self, writer: asyncio.StreamWriter, call: Call) -> None:
        error: str | None = None
        value: Any = None
        try:
            if call.method not in CALLS:
                raise ValueError(f"unknown call {call.method!r}")
            method = getattr(self._host, call.method)
            if call.adapter is not None:
                result = method(call.adapter)
            elif call.argument is None:
                result = method()
            else:
                result = method(with_sampling_params(call.argument))
            value = await result if asyncio.iscoroutine(result) else result
        except Exception as failure:
            error = f"{type(failure).__name__}: {failure}"
        try:
            frame = encode_frame(Reply(call.call_id, error, value))
        except (TypeError, ValueError) as failure:  # a value the protocol cannot carry
            frame = encode_frame(Reply(call.call_id, f"{type(failure).__name__}: {failure}"))
        writer.write(frame)

    async def _send_deltas(self, subscriber: str, writer: asyncio.StreamWriter) -> None:
        stream = self._host.deltas(subscriber)
        try:
            async for batch in stream:
                writer.write(encode_frame(Deltas(batch)))
                await writer.drain()
        finally:
            aclose = getattr(stream, "aclose", None)  # the contract promises an iterator
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


# ---- the client half: a router's link to one engine replica ----------------------------
# How long one ask for an engine replica's address may take: Serve holds a call for a
# replica that is not running yet (or any more), and the link then asks again.
ADDRESS_TIMEOUT_S = 10.0
# How long a link waits before it tries to reach a replica again.
RECONNECT_DELAY_S = 0.5


class SocketEngineLink:
    """An engine replica in a Serve deployment of its own, over its transport.

    The Serve handle is for control only: it names the replica's address and secret at
    each (re)connect, and both sides prove that secret before anything else crosses.
    Calls and deltas then travel on one TCP connection per router
    process and engine (engines/transport.py). A broken connection fails what waits on
    it; the router's listener then reconnects, to the replica Serve restarted if it died.
    """

    def __init__(self, handle: Any, replica: str | None = None, engine: str | None = None) -> None:
        """``replica``: in a scaled pool, the Serve replica id of this link's engine (the
        pool's request router sends the address call there, router/pool/membership.py).
        ``engine``: the engine's name, which the replica needs where it hosts several
        (``pools[].engines_per_process``)."""
        self._handle = handle
        self._replica = replica
        self._engine = engine
        self._connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._subscribed = False
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._connecting = asyncio.Lock()

    @property
    def ready(self) -> bool:
        return self._subscribed

    async def wait_ready(self) -> None:
        """Connect, once, whoever asks first (the listener or the readiness check): a
        second connection would carry calls on a socket that never subscribed."""
        async with self._connecting:
            while self._connection is None:
                try:
                    self._connection = await self._connect()
                except Exception as error:
                    link_logger.debug("engine replica not reachable yet: %s", error)
                    await asyncio.sleep(RECONNECT_DELAY_S)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        # Serve routes to a replica once its constructor (the engine's start) returned,
        # so the address is one of an engine that can serve.
        address = await asyncio.wait_for(self._transport_address(), ADDRESS_TIMEOUT_S)
        reader, writer = await asyncio.open_connection(address.host, address.port)
        try:
            await prove_to_engine(reader, writer, address.secret)
        except BaseException:
            writer.close()
            raise
        return reader, writer

    async def _transport_address(self) -> TransportAddress:
        if self._replica is not None:
            return await self._handle.transport_address.remote(replica=self._replica)
        if self._engine is not None:
            return await self._handle.transport_address.remote(engine=self._engine)
        return await self._handle.transport_address.remote()

    async def submit(self, request: GenerateRequest) -> None:
        await self._call("submit", request)

    def abort(self, request_id: str) -> None:
        writer = self._open_writer()
        if writer is not None:
            writer.write(encode_frame(Abort(request_id)))

    async def stats(self) -> EngineStats:
        return await self._call("stats", None)

    async def check_health(self) -> None:
        await self._call("check_health", None)

    async def add_lora(self, adapter: LoraAdapter) -> None:
        await self._call("add_lora", None, adapter)

    async def remove_lora(self, adapter: LoraAdapter) -> None:
        await self._call("remove_lora", None, adapter)

    async def deltas(self, subscriber: str) -> AsyncIterator[DeltaBatch]:
        """The engine's deltas for this router process, until the connection ends."""
        if self._connection is None:
            raise EngineUnavailable("not connected to the engine replica")
        reader, writer = self._connection
        writer.write(encode_frame(Subscribe(subscriber)))
        self._subscribed = True
        try:
            while True:
                message = await read_frame(reader, ENGINE_MESSAGES)
                if isinstance(message, Deltas):
                    yield message.batch
                else:
                    self._settle(message.call_id, message.error, message.value)
        finally:
            self._disconnect()

    def shutdown(self) -> None:
        self._disconnect()

    def _open_writer(self) -> asyncio.StreamWriter | None:
        """The connection's writer, if it has subscribed and is not closing."""
        connection = self._connection
        if not self._subscribed or connection is None or connection[1].is_closing():
            return None
        return connection[1]

    async def _call(self, method: str, argument: Any, adapter: LoraAdapter | None = None) -> Any:
        writer = self._open_writer()
        if writer is None:
            raise EngineUnavailable("the engine replica is not connected")
        call_id = next(self._call_ids)
        reply = asyncio.get_running_loop().create_future()
        self._replies[call_id] = reply
        try:
            writer.write(encode_frame(Call(call_id, method, argument, adapter)))
            return await reply
        finally:
            self._replies.pop(call_id, None)

    def _settle(self, call_id: int, error: str | None, value: Any) -> None:
        reply = self._replies.get(call_id)
        if reply is None or reply.done():
            return
        if error is None:
            reply.set_result(value)
        else:
            reply.set_exception(EngineFailed(error))

    def _disconnect(self) -> None:
        self._subscribed = False
        connection, self._connection = self._connection, None
        if connection is not None:
            connection[1].close()
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(EngineUnavailable("the engine replica went away"))
