"""Keeps the router's EnginePool in step with the scaled pools Ray Serve runs.

A scaled pool (``pools[].autoscaling``) is one Serve deployment that Serve's
autoscaling grows and shrinks (engines/pool_scaling.py). Serve tells each handle which
replicas run (router/pool/membership.py publishes it to router/pool/members.py); this
watcher adds each new replica to the pool as an engine of the pool's role, and takes
out each one Serve stopped: no new request goes to it, and the ones it carries finish
(``EnginePool.remove``), while the replica itself finishes them before it stops
(engines/host.py ``drain``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import router.pool.members as pool_members
from engines.contract import EngineLink
from engines.settings import member_name
from engines.transport import SocketEngineLink
from router.pool.engine_pool import EnginePool
from router.pool.pooled_engine import PooledEngine
from router.settings import ScaledPoolSettings

logger = logging.getLogger("splitserve.router")
# How often the watcher compares Serve's replicas with the pool's members.
WATCH_INTERVAL_S = 0.25


class PoolWatcher:
    def __init__(
        self,
        pool: EnginePool,
        scaled: list[tuple[ScaledPoolSettings, Any]],
        make_client: Callable[[str, str, EngineLink], PooledEngine],
    ) -> None:
        """``scaled``: each scaled pool's settings and its deployment's Serve handle;
        ``make_client(name, role, link)``: a pool member as the router builds them."""
        self._pool = pool
        self._scaled = scaled
        self._make_client = make_client
        self._populated = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._task: asyncio.Task[None] | None = None
        if not scaled:
            self._populated.set()

    def start(self) -> None:
        if self._scaled and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def populated(self) -> None:
        """Until every scaled pool has a member (readiness waits for this first)."""
        await self._populated.wait()

    def stop(self) -> None:
        for task in (self._task, *self._tasks):
            if task is not None:
                task.cancel()
        self._task = None

    async def _watch(self) -> None:
        for _, handle in self._scaled:
            # Serve's handle learns of the replicas once it is used: ask any replica.
            self._touch(handle)
        while True:
            for settings, handle in self._scaled:
                self._reconcile(settings, handle)
            if all(pool_members.members(s.deployment) for s, _ in self._scaled):
                self._populated.set()
            await asyncio.sleep(WATCH_INTERVAL_S)

    def _touch(self, handle: Any) -> None:
        self._spawn(_ask_any(handle))

    def _reconcile(self, settings: ScaledPoolSettings, handle: Any) -> None:
        running = pool_members.members(settings.deployment)
        if running is None:
            return
        wanted = {member_name(settings.name, replica): replica for replica in running}
        current = {m.name for m in self._pool.of_role(settings.role) if _in(m.name, settings)}
        for name in sorted(set(wanted) - current):
            member = self._make_client(
                name, settings.role, SocketEngineLink(handle, replica=wanted[name])
            )
            # Routed to once its first stats poll has reached it, not while it connects.
            member.healthy = False
            self._pool.add(member)
        for name in sorted(current - set(wanted)):
            leaving = self._pool.take_out(name)
            self._spawn(self._pool.finish(leaving, settings.drain_timeout_s))

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _in(name: str, settings: ScaledPoolSettings) -> bool:
    return name.startswith(f"{settings.name}-")


async def _ask_any(handle: Any) -> None:
    with contextlib.suppress(Exception):
        await handle.transport_address.remote()
