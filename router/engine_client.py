"""The router's side of one engine replica: submit, abort, and demultiplex its deltas.

Each router process subscribes once to each engine replica's ``deltas`` stream and
routes the batched deltas to per-request queues, so Ray carries one message per
engine step rather than one per token per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from deployments.protocol import GenerateChunk, GenerateFailure, GenerateRequest

logger = logging.getLogger("splitserve.router")
RESUBSCRIBE_DELAY_S = 0.5


class EngineFailed(RuntimeError):
    """The engine replica failed the request or went away while it ran."""


class EngineClient:
    def __init__(self, name: str, role: str, handle: Any, submit_timeout_s: float) -> None:
        self.name = name
        self.role = role
        self.in_flight = 0
        # False from a broken delta stream or failed stats poll until a poll succeeds again;
        # the dispatcher routes around unhealthy replicas where it has a choice.
        self.healthy = True
        self._submit_timeout_s = submit_timeout_s
        self._handle = handle
        self._subscriber = f"router-{uuid.uuid4().hex[:12]}"
        self._pending: dict[str, asyncio.Queue[GenerateChunk | GenerateFailure]] = {}
        self._listener: asyncio.Task[None] | None = None

    @property
    def handle(self) -> Any:
        return self._handle

    def start(self) -> None:
        if self._listener is None:
            self._listener = asyncio.get_running_loop().create_task(self._listen())

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Deltas of one request; closing the iterator early aborts it in the engine."""
        self.start()
        request.subscriber = self._subscriber
        queue: asyncio.Queue[GenerateChunk | GenerateFailure] = asyncio.Queue()
        self._pending[request.request_id] = queue
        finished = False
        try:
            try:
                await asyncio.wait_for(self._handle.submit.remote(request), self._submit_timeout_s)
            except TimeoutError:
                self.healthy = False
                raise EngineFailed(f"{self.name} did not accept the request in time") from None
            while True:
                item = await queue.get()
                if isinstance(item, GenerateFailure):
                    finished = True
                    raise EngineFailed(item.message)
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            self._pending.pop(request.request_id, None)
            if not finished:
                self._abort_soon(request.request_id)

    def _abort_soon(self, request_id: str) -> None:
        # Fire and forget: the caller is being torn down and must not wait on Ray.
        with contextlib.suppress(Exception):
            self._handle.abort.remote(request_id)

    async def _listen(self) -> None:
        while True:
            try:
                stream = self._handle.options(stream=True).deltas.remote(self._subscriber)
                async for batch in stream:
                    for request_id, item in batch:
                        queue = self._pending.get(request_id)
                        if queue is not None:
                            queue.put_nowait(item)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                logger.warning("delta stream from %s broke: %s", self.name, error)
            self.healthy = False
            # Whatever was in flight on that stream is lost with it.
            lost = GenerateFailure(f"engine replica {self.name} went away")
            for queue in self._pending.values():
                queue.put_nowait(lost)
            await asyncio.sleep(RESUBSCRIBE_DELAY_S)
