"""Ready means ready: the router answers from the moment it starts, but says "not yet"
until every engine can take a request.

Engines load in the background (tens of seconds for a real model). Until all of them
are ready, ``/health`` and ``/v1/models`` answer 503, and a generation request waits
up to ``router.ready_wait_s`` and then gets 503 with Retry-After: never a 500, and
never a 200 from ``/v1/models`` that clients would take as readiness.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable

from router.pool.pooled_engine import PooledEngine

logger = logging.getLogger("splitserve.router")


class Readiness:
    def __init__(
        self,
        replicas: Iterable[PooledEngine],
        on_engines_ready: Callable[[], Awaitable[None]] | None = None,
        members_known: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``on_engines_ready``: work between the engines being up and the router
        admitting requests (the TTFT estimate's calibration); ``members_known``: until
        the engines of scaled pools are known (Serve starts those, not the router)."""
        self._replicas = replicas
        self._on_engines_ready = on_engines_ready
        self._members_known = members_known
        self._ready = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._wait_for_engines())

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    async def wait(self, timeout_s: float) -> bool:
        """Whether the router is ready, after waiting up to ``timeout_s`` for it."""
        if not self._ready.is_set() and timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), timeout_s)
        return self._ready.is_set()

    def starting(self) -> list[str]:
        """The replicas whose engine is not up yet."""
        return [replica.name for replica in self._replicas if not replica.link.ready]

    async def _wait_for_engines(self) -> None:
        if self._members_known is not None:
            await self._members_known()
        await asyncio.gather(*(replica.link.wait_ready() for replica in self._replicas))
        if self._on_engines_ready is not None:
            try:
                await self._on_engines_ready()
            except Exception:  # calibration is an optimisation: serve without it
                logger.exception("the work before admitting requests failed")
        self._ready.set()
        logger.info("every engine is ready: %s", ", ".join(r.name for r in self._replicas))
