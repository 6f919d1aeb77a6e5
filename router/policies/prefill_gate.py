"""At most a few prefills inside an engine at once; the rest wait in the router, by
priority, so that high priority overtakes queued normal and low work.

An engine that is handed a burst of prompts batches all of them: their first tokens
come out together, late, and priority can only reorder what the engine has not
started. Holding the excess here keeps the engine's batch small (first tokens leave
as each prompt completes) and lets a high-priority request that arrives later go
next. Decoding requests are not held: a request counts against the gate from its
submission until its first token.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(order=True)
class _Waiter:
    priority: int
    order: int
    future: asyncio.Future[None] = field(compare=False)


class PrefillGate:
    """``limit`` prefills in the engine at once (None: no limit); waiters by (priority,
    arrival), lower engine priority first, as vLLM's priority scheduling orders them."""

    def __init__(self, limit: int | None) -> None:
        self._limit = limit
        self._inside = 0
        self._waiting: list[_Waiter] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for waiter in self._waiting if not waiter.future.done())

    async def enter(self, priority: int) -> None:
        """Wait for a place; cancelling the wait gives the turn up."""
        if self._limit is None or (self._inside < self._limit and not self.waiting):
            self._inside += 1
            return
        waiter = _Waiter(priority, next(self._order), asyncio.get_running_loop().create_future())
        heapq.heappush(self._waiting, waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.leave()  # admitted just as the wait was given up: pass the turn on
            raise

    def leave(self) -> None:
        """A prefill left the engine (first token, or the request ended)."""
        if self._limit is None:
            return
        self._inside -= 1
        while self._waiting and self._inside < self._limit:
            waiter = heapq.heappop(self._waiting)
            if not waiter.future.done():
                self._inside += 1
                waiter.future.set_result(None)
