"""The engine side of the router<->engine transport: one TCP connection per (router
process, engine replica), carrying calls one way and every request's deltas the other.

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
import logging
import secrets
import struct
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from engines.protocol import (
    CacheUpdate,
    EngineStats,
    GenerateChunk,
    GenerateFailure,
    GenerateRequest,
    LoraAdapter,
)

logger = logging.getLogger("splitserve.engine")
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


class HostedEngine(Protocol):
    """What the transport serves: engines.host.EngineHost's calls."""

    async def submit(self, request: GenerateRequest) -> None: ...

    async def abort(self, request_id: str) -> None: ...

    def deltas(self, subscriber: str) -> Any: ...

    def stats(self) -> EngineStats: ...

    async def check_health(self) -> None: ...

    async def add_lora(self, adapter: LoraAdapter) -> None: ...

    async def remove_lora(self, adapter: LoraAdapter) -> None: ...


class EngineTransportServer:
    """Serves one engine host to every router process that connects."""

    def __init__(self, host: HostedEngine) -> None:
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
            with contextlib.suppress(Exception):
                await stream.aclose()
