"""Ready means ready: the router answers from the moment it starts, but says "not yet"
until every engine can take a request; and once it serves, how healthy each engine is.

Engines load in the background (tens of seconds for a real model). Until all of them
are ready, ``/health`` and ``/v1/models`` answer 503, and a generation request waits
up to ``router.ready_wait_s`` and then gets 503 with Retry-After: never a 500, and
never a 200 from ``/v1/models`` that clients would take as readiness. ``/health`` then
reports each engine (``engine_health``), and Serve's health check of the router replica
restarts an engine hosted in the router's process that died (``check_local_engines``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from http import HTTPStatus

from engines.contract import EngineFailed
from router.http.errors import OpenAIError
from router.pool.pooled_engine import LocalEngineLink, PooledEngine

logger = logging.getLogger("splitserve.router")


class Readiness:
    def __init__(
        self,
        engines: Iterable[PooledEngine],
        on_engines_ready: Callable[[], Awaitable[None]] | None = None,
        members_known: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``on_engines_ready``: work between the engines being up and the router
        admitting requests (the TTFT estimate's calibration); ``members_known``: until
        the engines of scaled pools are known (Serve starts those, not the router)."""
        self._engines = engines
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
        """The engines that are not up yet."""
        return [engine.name for engine in self._engines if not engine.link.ready]

    def starting_error(self, retry_after_s: float) -> OpenAIError:
        """The 503 a request gets before every engine is ready."""
        waiting = ", ".join(self.starting()) or "the router"
        return OpenAIError(
            f"the model is not ready yet: {waiting} starting; retry",
            HTTPStatus.SERVICE_UNAVAILABLE,
            retry_after_s=max(1.0, retry_after_s),
        )

    async def engine_health(self, timeout_s: float) -> dict[str, str]:
        """Each engine's state by name: ``ok``, ``starting`` or ``unhealthy: <error>``."""
        engines = list(self._engines)
        states = await asyncio.gather(*(_health(engine, timeout_s) for engine in engines))
        return {engine.name: state for engine, state in zip(engines, states, strict=True)}

    async def _wait_for_engines(self) -> None:
        if self._members_known is not None:
            await self._members_known()
        await asyncio.gather(*(engine.link.wait_ready() for engine in self._engines))
        if self._on_engines_ready is not None:
            try:
                await self._on_engines_ready()
            except Exception:  # calibration is an optimisation: serve without it
                logger.exception("the work before admitting requests failed")
        self._ready.set()
        logger.info("every engine is ready: %s", ", ".join(r.name for r in self._engines))


async def check_local_engines(links: Sequence[LocalEngineLink], model: str) -> None:
    """Restart an engine in this process that died (LocalEngineLink does, when asked)
    while the others serve; only one that will not start again raises, and takes its
    router, and so every engine, with it (Serve restarts the router replica)."""
    for link in links:
        with contextlib.suppress(EngineFailed):
            await link.check_health()  # a dead engine starts its own replacement
        if link.gave_up:
            raise RuntimeError(f"an engine of {model} could not be restarted")


async def _health(engine: PooledEngine, timeout_s: float) -> str:
    if not engine.link.ready:
        return "starting"
    try:
        await asyncio.wait_for(engine.link.check_health(), timeout_s)
    except Exception as error:
        return f"unhealthy: {type(error).__name__}"
    return "ok"
