"""EngineGroupReplica without Serve: several synthetic engines in one process, each with
a transport of its own, found by name; a group whose engine fails to start stops those
that did."""

from __future__ import annotations

import asyncio

import pytest

from deployments.app import engine_names, engine_spec
from deployments.config import parse_app_config
from engines.host import EngineGroupReplica
from engines.settings import EngineSpec

# Serve awaits a replica's async __del__; outside Serve, Python's collector calls it too.
pytestmark = pytest.mark.filterwarnings("ignore:coroutine 'EngineGroupReplica.__del__'")

CONFIG = parse_app_config(
    {
        "shape": "dp",
        "pools": [{"replicas": 2, "engines_per_process": 2}],
        "engine": {"backend": "synthetic"},
    }
)


def _specs() -> list[EngineSpec]:
    return [engine_spec(CONFIG, *item) for item in engine_names(CONFIG)]


async def _accepts(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection(host, port)
    except OSError:
        return False
    writer.close()
    return True


async def test_each_engine_of_a_group_has_its_own_transport() -> None:
    group = EngineGroupReplica.__new__(EngineGroupReplica)
    await EngineGroupReplica.__init__(group, _specs())  # as Serve awaits it
    try:
        first, second = (group.transport_address(engine=f"engine-{i}") for i in range(2))
        assert first.port != second.port and first.secret != second.secret
        assert await _accepts(first.host, first.port)
        with pytest.raises(ValueError, match=r"no engine 'engine-7' here.*engine-0"):
            group.transport_address(engine="engine-7")
    finally:
        await group.__del__()
    assert not await _accepts(first.host, first.port)


async def test_a_group_that_fails_to_start_stops_the_engines_that_did() -> None:
    good, bad = _specs()
    bad = bad.model_copy(update={"backend": bad.backend.model_copy(update={"backend": "gone"})})
    group = EngineGroupReplica.__new__(EngineGroupReplica)
    with pytest.raises(Exception, match="gone"):
        await EngineGroupReplica.__init__(group, [good, bad])
    address = group._transports["engine-0"].address
    assert address is not None
    assert not await _accepts(address.host, address.port)
