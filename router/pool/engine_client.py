"""The router's side of one engine: submit, abort, and demultiplex its deltas.

Each router process subscribes once to each engine's ``deltas`` stream and routes the
batched deltas to per-request queues: one message per engine step rather than one per
token per request. The engine is reached through a link (``EngineLink``): an engine
replica of its own over the engine transport (one TCP connection, after both sides
prove the replica's secret; the Serve handle only names the address), or the engine
host in the router's own process (``router.engine_in_router``), behind the same calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from engines.protocol import (
    CacheUpdate,
    DeltaBatch,
    EngineStats,
    GenerateChunk,
    GenerateFailure,
    GenerateRequest,
    LoraAdapter,
)
from engines.transport import (
    ENGINE_MESSAGES,
    Abort,
    Call,
    Deltas,
    Subscribe,
    TransportAddress,
    encode_frame,
    prove_to_engine,
    read_frame,
)
from router.policies.prefill_gate import PrefillGate
from router.pool.replica_state import PrefillTicket, ReplicaState
from splitserve.processes import ENGINE_CANNOT_START

if TYPE_CHECKING:
    from engines.host import EngineHost

logger = logging.getLogger("splitserve.router")
RESUBSCRIBE_DELAY_S = 0.5
# How long one ask for an engine replica's address may take: Serve holds a call for a
# replica that is not running yet (or any more), and the link then asks again.
ADDRESS_TIMEOUT_S = 10.0
# How long a local engine's death waits for a stop to be announced before it counts as
# a crash and the engine is restarted (the stop signal reaches both within this).
STOP_GRACE_S = 1.0
# Put in a request's queue when its deadline passes (GenerateRequest.deadline).
PAST_DEADLINE = GenerateFailure("the request's deadline passed")


class EngineFailed(RuntimeError):
    """The engine replica failed the request or went away while it ran."""


class EngineUnavailable(EngineFailed):
    """The engine did not take the request (dead, restarting, or too slow to accept) or
    died under it: before a first token, the client may send it again as it is (503)."""


class EngineLink(Protocol):
    """How the router reaches one engine: the calls of engines.host.EngineHost."""

    async def submit(self, request: GenerateRequest) -> None: ...

    def abort(self, request_id: str) -> None:
        """Fire and forget: the caller may be being torn down."""

    def deltas(self, subscriber: str) -> AsyncIterator[DeltaBatch]: ...

    async def stats(self) -> EngineStats: ...

    async def check_health(self) -> None: ...

    async def add_lora(self, adapter: LoraAdapter) -> None: ...

    async def remove_lora(self, adapter: LoraAdapter) -> None: ...

    async def wait_ready(self) -> None:
        """Return once the engine can take requests."""

    @property
    def ready(self) -> bool:
        """It could take a request now."""


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
                    logger.debug("engine replica not reachable yet: %s", error)
                    await asyncio.sleep(RESUBSCRIBE_DELAY_S)

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


class LocalEngineLink:
    """An engine host in this process: the same calls, without Ray in between.

    It also does what Serve does for an engine replica: the engine starts on a worker
    thread, so the router answers (503 until every engine is ready) while it loads, and
    one that dies is replaced the same way while the router keeps serving the other
    engines. Until a host is live, calls fail as an unavailable replica's would.
    """

    def __init__(
        self, name: str, start_host: Callable[[], EngineHost], restart_attempts: int
    ) -> None:
        self._name = name
        self._start_host = start_host
        self._restart_attempts = restart_attempts
        self._host: EngineHost | None = None
        self._starting: asyncio.Task[None] | None = None
        self._failed_starts = 0
        self._ever_started = False
        self._ready = asyncio.Event()
        self._aborts: set[asyncio.Task[None]] = set()
        # Set when the application stops: an engine that dies then is not replaced (on
        # Ctrl-C the engine processes get the signal before the router is torn down).
        self._stopping = False

    def start(self) -> None:
        """Begin loading the engine (in the background); ``wait_ready`` awaits it."""
        if self._host is None and self._starting is None and not self.gave_up:
            self._starting = asyncio.get_running_loop().create_task(self._replace(None))

    @property
    def ready(self) -> bool:
        host = self._host
        return host is not None and not host.dead

    async def wait_ready(self) -> None:
        """Return once the engine can take requests; EngineUnavailable once it never will
        (too many failed starts). Cancel the wait to give up sooner."""
        while not self.ready:
            if self.gave_up:
                raise EngineUnavailable(f"the engine of {self._name} could not be started")
            self.start()
            await self._ready.wait()
            if not self.ready:
                self._ready.clear()

    @property
    def gave_up(self) -> bool:
        """Its engine could not be (re)started in this process: the process must go."""
        return self._failed_starts >= self._restart_attempts

    async def submit(self, request: GenerateRequest) -> None:
        await self._live_host().submit(request)

    def abort(self, request_id: str) -> None:
        if self._host is None:
            return  # the host is gone, and its requests with it
        task = asyncio.get_running_loop().create_task(self._host.abort(request_id))
        self._aborts.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._aborts.discard)

    def deltas(self, subscriber: str) -> AsyncIterator[DeltaBatch]:
        return self._live_host().deltas(subscriber)

    async def stats(self) -> EngineStats:
        return self._live_host().stats()

    async def check_health(self) -> None:
        await self._live_host().check_health()

    async def add_lora(self, adapter: LoraAdapter) -> None:
        await self._live_host().add_lora(adapter)

    async def remove_lora(self, adapter: LoraAdapter) -> None:
        await self._live_host().remove_lora(adapter)

    def shutdown(self) -> None:
        self._stopping = True
        if self._starting is not None:
            self._starting.cancel()
        if self._host is not None:
            self._host.shutdown()

    def _live_host(self) -> EngineHost:
        """The host, if its engine lives; else (re)start it and fail the call."""
        host = self._host
        if host is not None and not host.dead:
            return host
        if self._stopping:
            raise EngineUnavailable(f"the engine of {self._name} is stopping")
        if self._starting is None and not self.gave_up:
            self._starting = asyncio.get_running_loop().create_task(self._replace(host))
        state = "is starting" if host is None else "died; a new one is starting"
        raise EngineUnavailable(f"the engine of {self._name} {state}")

    async def _replace(self, dead: EngineHost | None) -> None:
        self._host = None
        self._ready.clear()
        try:
            if dead is not None:
                # A stop signal reaches the engine's processes and this one together:
                # give the stop a moment to say so before taking the death for a crash.
                await asyncio.sleep(STOP_GRACE_S)
                if self._stopping:
                    return
                logger.warning("engine %s died; starting a new one", self._name)
                dead.close_streams()  # subscribers resubscribe, to the new host
                await asyncio.to_thread(dead.shutdown)
            self._host = await asyncio.to_thread(self._start_host)
            self._failed_starts = 0
            self._ever_started = True
        except Exception as error:
            if _interpreter_stopping(error):
                self._stopping = True  # the process is exiting: nothing to restart
                return
            self._failed_starts += 1
            logger.exception("engine %s did not start", self._name)
            if self.gave_up and not self._ever_started:
                logger.error(
                    "%s: %s failed all %d starts: %s: %s",
                    ENGINE_CANNOT_START,
                    self._name,
                    self._failed_starts,
                    type(error).__name__,
                    error,
                )
        finally:
            self._starting = None
            self._ready.set()  # waiters look again: ready, or start anew


def _interpreter_stopping(error: Exception) -> bool:
    # asyncio.to_thread's executor refuses work once the interpreter begins to exit.
    return isinstance(error, RuntimeError) and "after shutdown" in str(error)


class _GatePass:
    """One request's place in a prefill gate: entered once, left once."""

    def __init__(self, gate: PrefillGate) -> None:
        self._gate = gate
        self._inside = False

    async def enter(self, priority: int) -> None:
        await self._gate.enter(priority)
        self._inside = True

    def leave(self) -> None:
        if self._inside:
            self._inside = False
            self._gate.leave()


class EngineClient:
    def __init__(
        self,
        name: str,
        role: str,
        link: EngineLink,
        submit_timeout_s: float,
        state: ReplicaState | None = None,
        gate: PrefillGate | None = None,
    ) -> None:
        self.name = name
        self.role = role
        self.state = state or ReplicaState()
        # False from a broken delta stream or failed stats poll until a poll succeeds again;
        # the dispatcher routes around unhealthy replicas where it has a choice.
        self.healthy = True
        # The LoRA adapters this engine has loaded, by name: the dispatcher prefers an
        # engine that holds a request's adapter (another would load it first).
        self.adapters: set[str] = set()
        self._submit_timeout_s = submit_timeout_s
        self._gate = gate or PrefillGate(None)
        self._link = link
        self._subscriber = f"router-{uuid.uuid4().hex[:12]}"
        self._pending: dict[str, asyncio.Queue[GenerateChunk | GenerateFailure]] = {}
        self._listener: asyncio.Task[None] | None = None

    @property
    def link(self) -> EngineLink:
        return self._link

    @property
    def in_flight(self) -> int:
        return self.state.in_flight

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        self.state.in_flight = value

    def start(self) -> None:
        if self._listener is None:
            self._listener = asyncio.get_running_loop().create_task(self._listen())

    def stop_listening(self) -> None:
        """Cancel the listener (on the event loop's thread: a task is not thread-safe)."""
        if self._listener is not None:
            self._listener.cancel()
            self._listener = None

    def shutdown_link(self) -> None:
        """Shut down what the link holds (an engine in this process); any thread."""
        shutdown = getattr(self._link, "shutdown", None)
        if shutdown is not None:
            shutdown()

    async def stop(self) -> None:
        """Stop listening to the engine's deltas (the router is going away)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    async def generate(
        self,
        request: GenerateRequest,
        prefill_tokens: int | None = None,
        on_accepted: Callable[[], None] | None = None,
    ) -> AsyncIterator[GenerateChunk]:
        """Deltas of one request; closing the iterator early aborts it in the engine.

        ``prefill_tokens``: prompt tokens this replica must compute before the first token
        (the prompt less the expected prefix-cache hit; 0 when the KV comes from a prefill
        replica), queued in the replica's state until that token arrives. ``on_accepted``
        is called once the engine replica has taken the request.
        """
        self.start()
        request.subscriber = self._subscriber
        queue: asyncio.Queue[GenerateChunk | GenerateFailure] = asyncio.Queue()
        self._pending[request.request_id] = queue
        if prefill_tokens is None:
            prefill_tokens = len(request.prompt_token_ids)
        ticket = self.state.enqueue_prefill(prefill_tokens, time.perf_counter(), request.priority)
        finished = False
        # Each of the request's n completions ends with a finish reason of its own.
        unfinished = getattr(request.sampling_params, "n", 1) or 1
        timer = None
        loop = asyncio.get_running_loop()
        if request.deadline is not None:
            timer = loop.call_at(request.deadline, queue.put_nowait, PAST_DEADLINE)
        inside = _GatePass(self._gate) if prefill_tokens else None
        try:
            if inside is not None:
                wait_s = request.deadline - loop.time() if request.deadline else None
                await asyncio.wait_for(inside.enter(request.priority), wait_s)
            self.state.enter_engine(ticket)
            try:
                await asyncio.wait_for(self._link.submit(request), self._submit_timeout_s)
            except TimeoutError:
                self.healthy = False
                raise EngineUnavailable(f"{self.name} did not accept the request in time") from None
            if on_accepted is not None:
                on_accepted()
            async for item in self._deltas(queue, ticket):
                if inside is not None and item.token_ids:
                    inside.leave()  # its prefill is done: the next one may enter the engine
                unfinished -= item.finish_reason is not None
                finished = unfinished <= 0
                yield item
                if finished:
                    return
        except EngineFailed:
            finished = True  # nothing left to abort
            raise
        finally:
            if inside is not None:
                inside.leave()
            if timer is not None:
                timer.cancel()
            self._pending.pop(request.request_id, None)
            self.state.finish_prefill(ticket, time.perf_counter(), first_token=False)
            if not finished:
                self._abort_soon(request.request_id)

    async def _deltas(
        self,
        queue: asyncio.Queue[GenerateChunk | GenerateFailure],
        ticket: PrefillTicket,
    ) -> AsyncIterator[GenerateChunk]:
        """The queue's chunks, timing the first token and the steps after it."""
        last_token_at: float | None = None
        while True:
            item = await queue.get()
            if item is PAST_DEADLINE:
                raise TimeoutError(f"{self.name} did not finish the request in time")
            if isinstance(item, GenerateFailure):
                raise (EngineUnavailable if item.engine_dead else EngineFailed)(item.message)
            if item.token_ids:
                now = time.perf_counter()
                if last_token_at is None:
                    # A non-streamed answer arrives whole at the end: not a first-token time.
                    timed = len(item.token_ids) == 1 or item.finish_reason is None
                    self.state.finish_prefill(ticket, now, first_token=timed)
                else:
                    self.state.step_s.add((now - last_token_at) / len(item.token_ids))
                last_token_at = now
            yield item

    def _abort_soon(self, request_id: str) -> None:
        # Fire and forget: the caller is being torn down and must not wait on Ray.
        with contextlib.suppress(Exception):
            self._link.abort(request_id)

    async def _listen(self) -> None:
        while True:
            try:
                await self._link.wait_ready()
                async for batch in self._link.deltas(self._subscriber):
                    for request_id, item in batch:
                        if isinstance(item, CacheUpdate):
                            self.state.apply_cache_update(item)
                            continue
                        queue = self._pending.get(request_id)
                        if queue is not None:
                            queue.put_nowait(item)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                logger.warning("delta stream from %s broke: %s", self.name, error)
            self.healthy = False
            # The cache it described may be gone too; the next stream starts with a snapshot.
            self.state.blocks = None
            # Whatever was in flight on that stream is lost with it.
            lost = GenerateFailure(f"engine replica {self.name} went away", engine_dead=True)
            for queue in self._pending.values():
                queue.put_nowait(lost)
            await asyncio.sleep(RESUBSCRIBE_DELAY_S)
