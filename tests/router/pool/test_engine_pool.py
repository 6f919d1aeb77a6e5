"""The router's EnginePool with synthetic engines in this process: members join and
leave while requests run, the dispatcher sees the change at once, and a member that
leaves finishes what it carries first."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from deployments.app import engine_names, engine_spec
from deployments.config import parse_app_config
from engines.protocol import GenerateRequest
from engines.synthetic import SyntheticEngineHost
from router.dispatch import Dispatcher
from router.pool.engine_pool import EnginePool
from router.pool.pooled_engine import LocalEngineLink, PooledEngine

CONFIG = parse_app_config(
    {
        "shape": "dp",
        "pools": [{"replicas": 3}],
        "engine": {"backend": "synthetic", "step_interval_s": 0.005},
    }
)
WAIT_S = 10


def _member(index: int) -> PooledEngine:
    name, pool, replica_index = engine_names(CONFIG)[index]
    spec = engine_spec(CONFIG, name, pool, replica_index)
    link = LocalEngineLink(name, functools.partial(SyntheticEngineHost, spec), 1)
    return PooledEngine(name, "mixed", link, 5.0)


async def _ready(pool: EnginePool) -> None:
    await asyncio.wait_for(asyncio.gather(*(m.link.wait_ready() for m in pool)), WAIT_S)


def _request(request_id: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id, "", [1, 2, 3], SimpleNamespace(max_tokens=max_tokens))


async def _serve(dispatcher: Dispatcher, request_id: str, max_tokens: int = 3) -> str:
    """One request through the dispatcher; the replica that served it."""
    plan = dispatcher.plan(_request(request_id, max_tokens), "normal")
    dispatch = dispatcher.start(plan)
    chunks = [chunk async for chunk in dispatch.stream]
    assert chunks[-1].finish_reason == "length"
    return plan.main.engine.name


async def test_a_member_added_takes_requests_and_one_removed_takes_none() -> None:
    pool = EnginePool([_member(0)])
    pool.start()
    dispatcher = Dispatcher(CONFIG.ingress_settings(), pool)
    await _ready(pool)
    assert {await _serve(dispatcher, f"a{i}") for i in range(4)} == {"engine-0"}
    pool.add(_member(1))
    await _ready(pool)
    assert {await _serve(dispatcher, f"b{i}") for i in range(4)} == {"engine-0", "engine-1"}
    await pool.remove("engine-0", drain_timeout_s=WAIT_S)
    assert {await _serve(dispatcher, f"c{i}") for i in range(4)} == {"engine-1"}
    assert pool.names == ["engine-1"]
    pool.close()


async def test_a_member_that_leaves_finishes_its_requests_first() -> None:
    pool = EnginePool([_member(0), _member(1)])
    pool.start()
    dispatcher = Dispatcher(CONFIG.ingress_settings(), pool)
    await _ready(pool)
    plan = dispatcher.plan(_request("long", 200), "normal")
    leaving = plan.main.engine
    dispatch = dispatcher.start(plan)
    leaving.state.in_flight += 1  # as a request's life counts it (router/lifecycle.py)
    first = await anext(dispatch.stream)
    removal = asyncio.create_task(pool.remove(leaving.name, drain_timeout_s=WAIT_S))
    await asyncio.sleep(0)
    assert leaving.name not in pool.names  # no new request goes there
    rest = [chunk async for chunk in dispatch.stream]
    leaving.state.in_flight -= 1
    assert await asyncio.wait_for(removal, WAIT_S) is leaving
    tokens = [first, *rest]
    assert sum(len(chunk.token_ids) for chunk in tokens) == 200
    assert tokens[-1].finish_reason == "length"
    pool.close()


def test_names_are_unique_and_unknown_names_are_named() -> None:
    pool = EnginePool([_member(0)])
    with pytest.raises(ValueError, match="already has an engine replica named 'engine-0'"):
        pool.add(_member(0))
    with pytest.raises(KeyError, match="no engine replica named 'engine-9'"):
        pool.get("engine-9")


async def test_closing_shuts_every_engine_down_side_by_side() -> None:
    """vLLM gives each engine core seconds to exit: one after another, a router's stop
    took that many times its engine count. Each link here waits for all the others."""
    members = [_member(i) for i in range(3)]
    pool = EnginePool(members)
    pool.start()
    await _ready(pool)
    all_shutting_down = threading.Barrier(len(members), timeout=WAIT_S)
    for member in members:
        shutdown = member.link.shutdown

        def waits_for_the_others(shutdown: Callable[[], None] = shutdown) -> None:
            all_shutting_down.wait()  # raises BrokenBarrierError when run one by one
            shutdown()

        member.link.shutdown = waits_for_the_others  # type: ignore[method-assign]
    pool.close()
    assert not all_shutting_down.broken
