"""The router follows a scaled pool as Serve runs it: each replica Serve starts joins the
EnginePool under its replica id, and each one Serve stops leaves it after its requests
finish. Serve's side (which replicas run) is what the pool's request router publishes."""

from __future__ import annotations

import asyncio
from typing import Any

import router.pool.members as pool_members
from engines.contract import EngineLink
from engines.transport import SocketEngineLink
from router.pool.engine_pool import EnginePool
from router.pool.pooled_engine import PooledEngine
from router.pool.watcher import PoolWatcher
from router.settings import ScaledPoolSettings

SETTINGS = ScaledPoolSettings(
    deployment="test-decode-pool", name="decode", role="decode", drain_timeout_s=5.0
)


class _Call:
    """A Serve handle method whose calls never answer (no replica runs here)."""

    def __init__(self) -> None:
        self.targets: list[Any] = []

    def remote(self, **kwargs: Any) -> Any:
        self.targets.append(kwargs.get("replica"))
        return asyncio.sleep(3600)


class _Handle:
    def __init__(self) -> None:
        self.transport_address = _Call()


def _client(name: str, role: str, link: EngineLink) -> PooledEngine:
    return PooledEngine(name, role, link, 5.0)


async def _until(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


def test_members_follow_serves_replicas_and_leave_after_their_requests() -> None:
    async def scenario() -> dict[str, Any]:
        pool = EnginePool()
        handle = _Handle()
        watcher = PoolWatcher(pool, [(SETTINGS, handle)], _client)
        watcher.start()
        seen: dict[str, Any] = {}
        populated = asyncio.create_task(watcher.populated())
        await asyncio.sleep(0.05)
        seen["populated_before_any"] = populated.done()

        pool_members.publish(SETTINGS.deployment, ["r2", "r1"])
        await _until(lambda: len(pool) == 2)
        await asyncio.wait_for(populated, 5)
        seen["joined"] = sorted(pool.names)
        seen["routed_before_a_poll"] = [m.healthy for m in pool]
        seen["links"] = {type(m.link) for m in pool}

        leaving = pool.get("decode-r1")
        leaving.state.in_flight = 1  # a stream still running on the replica Serve stops
        pool_members.publish(SETTINGS.deployment, ["r2", "r3"])
        await _until(lambda: "decode-r3" in pool.names)
        seen["while_draining"] = sorted(pool.names)
        await asyncio.sleep(0.3)  # several watches: it is taken out once, not again
        leaving.state.in_flight = 0
        await asyncio.sleep(0.2)
        seen["targets"] = set(handle.transport_address.targets)
        watcher.stop()
        pool.close()
        return seen

    seen = asyncio.run(scenario())
    assert seen["populated_before_any"] is False
    assert seen["joined"] == ["decode-r1", "decode-r2"]
    assert seen["routed_before_a_poll"] == [False, False]
    assert seen["links"] == {SocketEngineLink}
    assert seen["while_draining"] == ["decode-r2", "decode-r3"]
    # Each member's link asks its own replica for the address; one untargeted call
    # first makes Serve's handle learn the replicas at all.
    assert seen["targets"] == {None, "r1", "r2", "r3"}
