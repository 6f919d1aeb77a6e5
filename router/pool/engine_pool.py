"""The router's engines: one list that the dispatcher, the stats poller, readiness and
calibration all read, with add and remove, so that a pool can grow and shrink while
the router serves (a scaled pool's members follow Serve: router/pool/watcher.py).

Members are PooledEngines; each reaches its engine through its link (a Serve replica
of its own over the engine transport, or an engine host in this process).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator

from router.pool.engine_index import EngineIndex
from router.pool.pooled_engine import PooledEngine

logger = logging.getLogger("splitserve.router")
# How often a drain looks whether the member's last request has finished.
DRAIN_POLL_S = 0.05


class EnginePool:
    def __init__(self, members: list[PooledEngine] | None = None) -> None:
        self._members: list[PooledEngine] = []
        # Its members by what decisions ask, kept as their states change.
        self.index = EngineIndex()
        for member in members or ():
            self._check_new(member)
            self._members.append(member)
            self.index.add(member)

    def __iter__(self) -> Iterator[PooledEngine]:
        # A copy: members may come and go while a caller awaits between items.
        return iter(list(self._members))

    def __len__(self) -> int:
        return len(self._members)

    @property
    def names(self) -> list[str]:
        return [member.name for member in self._members]

    @property
    def roles(self) -> list[str]:
        """Each role once, in the order its first member joined."""
        return list(dict.fromkeys(member.role for member in self._members))

    def of_role(self, role: str) -> list[PooledEngine]:
        """The members of ``role``, in the order they joined (read, do not change it)."""
        return self.index.of_role(role)

    def get(self, name: str) -> PooledEngine:
        for member in self._members:
            if member.name == name:
                return member
        raise KeyError(f"no engine replica named {name!r}; the pool has {self.names}")

    def start(self) -> None:
        """Start listening to every member's engine (idempotent)."""
        for member in self._members:
            member.start()

    def add(self, member: PooledEngine) -> None:
        """A new member takes requests once its engine is ready, like the first ones."""
        self._check_new(member)
        self._members.append(member)
        self.index.add(member)
        member.start()
        logger.info("engine %s (%s) joined the pool", member.name, member.role)

    async def remove(self, name: str, drain_timeout_s: float) -> PooledEngine:
        """Take a member out: no new request goes to it at once, and the requests it
        carries finish first (up to ``drain_timeout_s``), so none is dropped."""
        member = self.take_out(name)
        await self.finish(member, drain_timeout_s)
        return member

    def take_out(self, name: str) -> PooledEngine:
        """No new request goes to the member from now on (``finish`` it after)."""
        member = self.get(name)
        self._members.remove(member)
        self.index.remove(member)
        return member

    async def finish(self, member: PooledEngine, drain_timeout_s: float) -> None:
        """Stop a member taken out once the requests it carries have finished."""
        name = member.name
        try:
            await asyncio.wait_for(_drained(member), drain_timeout_s)
        except TimeoutError:
            logger.warning(
                "engine %s left the pool with %d requests still in flight",
                name,
                member.state.in_flight,
            )
        await member.stop()
        logger.info("engine %s (%s) left the pool", member.name, member.role)

    def close(self) -> None:
        """Stop every member without waiting for its requests (the router is torn down).

        Engines shut down side by side: vLLM gives each engine core up to 5 s to exit
        before it kills it, and one after another a DP or PD router took 5 s more per
        engine to stop (the serve logs of a full test run)."""
        members = list(self._members)
        for member in members:
            member.stop_listening()
        closing = [
            threading.Thread(target=m.shutdown_link, name=f"close-{m.name}") for m in members
        ]
        for thread in closing:
            thread.start()
        for thread in closing:
            thread.join()

    def _check_new(self, member: PooledEngine) -> None:
        if member.name in self.names:
            raise ValueError(f"the pool already has an engine replica named {member.name!r}")


async def _drained(member: PooledEngine) -> None:
    while member.state.in_flight > 0:
        await asyncio.sleep(DRAIN_POLL_S)
