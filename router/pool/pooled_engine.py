"""The router's side of one engine: submit, abort, and demultiplex its deltas.

Each router process subscribes once to each engine's ``deltas`` stream and routes the
batched deltas to per-request mailboxes (router/pool/mailbox.py): one message per engine
step rather than one per token per request, and a request read behind its engine reads
what waits as one chunk. The engine is reached through a link (``EngineLink``): an engine
replica of its own over the engine transport (one TCP connection, after both sides
prove the replica's secret; the Serve handle only names the address), or the engine
host in the router's own process (``router.engine_in_router``), behind the same calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from engines.contract import EngineBackend, EngineFailed, EngineLink, EngineUnavailable
from engines.protocol import (
    CacheUpdate,
    DeltaBatch,
    EngineStats,
    GenerateChunk,
    GenerateFailure,
    GenerateRequest,
    LoraAdapter,
)
from router.policies.prefill_gate import PrefillGate
from router.pool.engine_state import EngineState, StreamTiming
from router.pool.mailbox import DeltaMailbox
from splitserve.processes import ENGINE_CANNOT_START

logger = logging.getLogger("splitserve.router")
RESUBSCRIBE_DELAY_S = 0.5
# How long a local engine's death waits for a stop to be announced before it counts as
# a crash and the engine is restarted (the stop signal reaches both within this).
STOP_GRACE_S = 1.0
# Put in a request's mailbox when its deadline passes (GenerateRequest.deadline).
PAST_DEADLINE = GenerateFailure("the request's deadline passed")


class LocalEngineLink:
    """An engine host in this process: the same calls, without Ray in between.

    It also does what Serve does for an engine replica: the engine starts on a worker
    thread, so the router answers (503 until every engine is ready) while it loads, and
    one that dies is replaced the same way while the router keeps serving the other
    engines. Until a host is live, calls fail as an unavailable replica's would.
    """

    def __init__(
        self, name: str, start_host: Callable[[], EngineBackend], restart_attempts: int
    ) -> None:
        self._name = name
        self._start_host = start_host
        self._restart_attempts = restart_attempts
        self._host: EngineBackend | None = None
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

    def _live_host(self) -> EngineBackend:
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

    async def _replace(self, dead: EngineBackend | None) -> None:
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


class PooledEngine:
    """One engine as the router's pool holds it: its link, what the router knows of its
    load and cache (``EngineState``), and its requests' mailboxes. (Not vLLM's
    ``EngineClient``, which router/http/vllm_frontend.py implements over the dispatch.)"""

    def __init__(
        self,
        name: str,
        role: str,
        link: EngineLink,
        submit_timeout_s: float,
        state: EngineState | None = None,
        gate: PrefillGate | None = None,
    ) -> None:
        self.name = name
        self.role = role
        self.state = state or EngineState()
        self._healthy = True
        # The LoRA adapters this engine has loaded, by name: the dispatcher prefers an
        # engine that holds a request's adapter (another would load it first).
        self.adapters: set[str] = set()
        self._submit_timeout_s = submit_timeout_s
        self._gate = gate or PrefillGate(None)
        self._link = link
        self._subscriber = f"router-{uuid.uuid4().hex[:12]}"
        self._pending: dict[str, DeltaMailbox] = {}
        self._listener: asyncio.Task[None] | None = None

    @property
    def link(self) -> EngineLink:
        return self._link

    @property
    def healthy(self) -> bool:
        """False from a broken delta stream or failed stats poll until a poll succeeds
        again; the dispatcher routes around unhealthy engines where it has a choice."""
        return self._healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        if value is not self._healthy:
            self._healthy = value
            self.state.changed()

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
        self._link.shutdown()

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
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Deltas of one request; closing the iterator early aborts it in the engine.

        ``prefill_tokens``: prompt tokens this engine must compute before the first token
        (the prompt less the expected prefix-cache hit; 0 when the KV comes from a prefill
        engine), queued in the engine's state until that token arrives. ``on_accepted``
        is called once the engine has taken the request.
        """
        self.start()
        request.subscriber = self._subscriber
        mailbox = DeltaMailbox()
        self._pending[request.request_id] = mailbox
        if prefill_tokens is None:
            prefill_tokens = len(request.prompt_token_ids)
        timing = self.state.open_stream(prefill_tokens, time.perf_counter(), request.priority)
        finished = False
        # Each of the request's n completions ends with a finish reason of its own.
        unfinished = getattr(request.sampling_params, "n", 1) or 1
        timer = None
        loop = asyncio.get_running_loop()
        if request.deadline is not None:
            timer = loop.call_at(request.deadline, mailbox.put, PAST_DEADLINE)
        inside = _GatePass(self._gate) if prefill_tokens else None
        try:
            if inside is not None:
                wait_s = request.deadline - loop.time() if request.deadline else None
                await asyncio.wait_for(inside.enter(request.scheduling_priority()), wait_s)
            self.state.enter_engine(timing.ticket)
            try:
                await asyncio.wait_for(self._link.submit(request), self._submit_timeout_s)
            except TimeoutError:
                self.healthy = False
                raise EngineUnavailable(f"{self.name} did not accept the request in time") from None
            if on_accepted is not None:
                on_accepted()
            async for item in self._deltas(mailbox, timing):
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
            timing.closed(time.perf_counter())
            if not finished:
                self._abort_soon(request.request_id)

    async def _deltas(
        self, mailbox: DeltaMailbox, timing: StreamTiming
    ) -> AsyncIterator[GenerateChunk]:
        """The mailbox's chunks, each with tokens timed (``StreamTiming``)."""
        while True:
            item = await mailbox.get()
            if item is PAST_DEADLINE:
                raise TimeoutError(f"{self.name} did not finish the request in time")
            if isinstance(item, GenerateFailure):
                raise (EngineUnavailable if item.engine_dead else EngineFailed)(item.message)
            if item.token_ids:
                timing.tokens(
                    time.perf_counter(), len(item.token_ids), item.finish_reason is not None
                )
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
                        mailbox = self._pending.get(request_id)
                        if mailbox is not None:
                            mailbox.put(item)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                logger.warning("delta stream from %s broke: %s", self.name, error)
            self.healthy = False
            # The cache it described may be gone too; the next stream starts with a snapshot.
            self.state.forget_blocks()
            # Whatever was in flight on that stream is lost with it.
            lost = GenerateFailure(f"engine replica {self.name} went away", engine_dead=True)
            for mailbox in self._pending.values():
                mailbox.put(lost)
            await asyncio.sleep(RESUBSCRIBE_DELAY_S)
