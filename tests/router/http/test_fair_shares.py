"""Fair shares between API keys over the router's whole request path, in process: a
key's flood neither starts before another key's request nor takes its place in a full
queue (router/policies/fair_share.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from engines.tiny_model import EMBEDDED_MODEL_NAME
from tests.support.in_process_router import (
    COMPLETIONS,
    http_client,
    in_process_router,
    metric,
    only_model,
    openai_error,
    ready,
    until,
)

FLOOD_KEY = "sk-flood-0123456789"
LIGHT_KEY = "sk-light-0123456789"
AUTH = {"keys": [{"name": "flood", "key": FLOOD_KEY}, {"name": "light", "key": LIGHT_KEY}]}
FLOOD = {"authorization": f"Bearer {FLOOD_KEY}"}
LIGHT = {"x-api-key": LIGHT_KEY}
KEY_REQUESTS = "splitserve_key_requests_total"


def completion(max_tokens: int = 1) -> dict[str, Any]:
    return {"model": EMBEDDED_MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": max_tokens}


async def test_a_keys_request_starts_before_another_keys_backlog() -> None:
    # One prompt inside the engine at a time, the rest held in the router's prefill gate,
    # which orders them as engines that schedule by priority do: priority, then turn.
    args = {
        "auth": AUTH,
        "engine": {"backend": "synthetic", "step_interval_s": 0.5},
        "router": {"max_prefills_per_engine": 1},
        "qos": {"calibration_prompt_tokens": 0},
    }
    async with in_process_router(**args) as router, http_client(router) as client:
        await ready(client)
        (engine,) = only_model(router).pool
        gate = engine._gate
        finished: list[str] = []

        async def send(name: str, headers: dict[str, str]) -> None:
            response = await client.post(COMPLETIONS, json=completion(), headers=headers)
            assert response.status_code == 200, response.text
            finished.append(name)

        flood = [asyncio.create_task(send("flood", FLOOD)) for _ in range(6)]
        # The first got its token at once; the next is inside until the engine's next
        # step, half a second away, and four are held.
        await until(lambda: gate.waiting == 4)
        light = asyncio.create_task(send("light", LIGHT))
        await asyncio.gather(*flood, light)
        # In arrival order it would be last; its turn puts it next, after the one inside.
        assert finished.index("light") == 2, finished
        assert await metric(client, KEY_REQUESTS, FLOOD, key="flood", outcome="admitted") == 6
        ttft = "splitserve_key_time_to_first_token_seconds_count"
        assert await metric(client, ttft, LIGHT, key="light") == 0  # whole answers only


async def test_a_full_queue_refuses_the_key_over_its_share_and_admits_the_other() -> None:
    args = {
        "auth": AUTH,
        "engine": {"backend": "synthetic", "step_interval_s": 5.0},
        "router": {"request_timeout_s": 1.0},
        "qos": {
            "calibration_prompt_tokens": 0,
            "enabled": True,
            "queue_caps": {"high": 4, "normal": 4, "low": 4},
        },
    }
    async with in_process_router(**args) as router, http_client(router) as client:
        await ready(client)
        warm = await client.post(COMPLETIONS, json=completion(), headers=FLOOD)
        assert warm.status_code == 200  # the engine's next step is 5 s away
        dispatcher = only_model(router).lifecycle.dispatcher

        async def queue(headers: dict[str, str], waiting: int) -> asyncio.Task[httpx.Response]:
            task = asyncio.create_task(client.post(COMPLETIONS, json=completion(), headers=headers))
            await until(lambda: dispatcher.queued_requests() == waiting)
            return task

        held = [await queue(FLOOD, waiting) for waiting in (1, 2, 3, 4)]  # normal's cap
        refused = await client.post(COMPLETIONS, json=completion(), headers=FLOOD)
        assert "too many requests waiting (4" in openai_error(refused, 429, "RateLimitError", None)
        # The light key has no request waiting: half of a full queue is its share.
        held += [await queue(LIGHT, waiting) for waiting in (5, 6)]
        over = await client.post(COMPLETIONS, json=completion(), headers=LIGHT)
        assert "too many requests waiting (6" in openai_error(over, 429, "RateLimitError", None)
        waiting = "splitserve_key_waiting_requests"
        assert await metric(client, waiting, LIGHT, key="flood", priority="normal") == 4
        assert await metric(client, waiting, LIGHT, key="light", priority="normal") == 2
        assert [(await task).status_code for task in held] == [504] * 6  # the timeout
        counted = {
            (key, outcome): await metric(client, KEY_REQUESTS, LIGHT, key=key, outcome=outcome)
            for key in ("flood", "light")
            for outcome in ("admitted", "refused")
        }
        assert counted == {
            ("flood", "admitted"): 5,  # the warm request and the four held
            ("flood", "refused"): 1,
            ("light", "admitted"): 2,
            ("light", "refused"): 1,
        }
        assert await metric(client, waiting, LIGHT, key="light") == 0  # given back
