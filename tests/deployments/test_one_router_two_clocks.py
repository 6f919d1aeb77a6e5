"""One router on two clocks: a trace replayed through the in-process router on real-time
simulated engines, and offline in virtual time (deployments/simulate.py), gets the same
decisions request by request: the engine each request was generated on, where its
prompt was computed and why, and whether it was admitted.

The trace keeps every decision away from its threshold by more than this box's timing
noise: its requests are spaced so that each finds the engines as the one before left
them, and its low-priority burst comes faster than a prefill ends."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest

from deployments.simulate import OfflineCluster
from engines.tiny_model import EMBEDDED_MODEL_NAME
from splitserve.offline_exchange import Arrival
from tests.support.in_process_router import (
    COMPLETIONS,
    PREFILL,
    PREFILL_REPLICA,
    REPLICA,
    _config,
    http_client,
    in_process_router,
    ready,
)
from tests.support.simulated import round_profile

STEP_S = 0.01
PER_TOKEN_S = 0.0002  # a 600-token prefill: 0.13 s
MAX_TOKENS = 4
SPACED_S = 0.4  # longer than any request of the trace alone
BURST_S = 0.02  # far shorter than a prefill
# Far from every estimate the burst makes: 0.14 s for the first, 0.27 s behind one.
LOW_TTFT_LIMIT_S = 0.2
DECISION_HEADERS = (REPLICA, PREFILL, PREFILL_REPLICA)


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(10, 200) for _ in range(length)]


def _trace() -> list[Arrival]:
    """Short and long prompts, a long one again (cached on the decode engine now) and
    grown, then a burst of low priority that the TTFT limit sheds, then the cluster
    after it."""
    rng = random.Random(7)
    shared = _prompt(rng, 400)
    spaced = [
        _prompt(rng, 40),
        shared,
        shared,
        shared + _prompt(rng, 300),
        _prompt(rng, 200),
    ]
    arrivals = [Arrival(i, i * SPACED_S, p, MAX_TOKENS, "normal") for i, p in enumerate(spaced)]
    burst_at = len(spaced) * SPACED_S
    for k in range(6):
        at = burst_at + k * BURST_S
        arrivals.append(Arrival(len(arrivals), at, _prompt(rng, 600), MAX_TOKENS, "low"))
    after = burst_at + 1.0
    for k, prompt in enumerate([shared, _prompt(rng, 300), _prompt(rng, 30)]):
        arrivals.append(Arrival(len(arrivals), after + k * SPACED_S, prompt, MAX_TOKENS, "normal"))
    return arrivals


def _args(tmp_path: Path, shape: dict[str, Any]) -> dict[str, Any]:
    profile = round_profile(
        tmp_path, STEP_S, compute_per_token_s=PER_TOKEN_S, handover_bytes_per_s=1e8
    )
    return {
        **shape,
        "engine": {"backend": "simulated", "profile": profile},
        "qos": {"enabled": True, "early_rejection_s": {"low": LOW_TTFT_LIMIT_S}},
    }


async def _served(args: dict[str, Any], trace: list[Arrival]) -> list[tuple[int, dict[str, str]]]:
    """Each request's status and decision headers through the router, in real time."""
    async with in_process_router(**args) as router, http_client(router) as client:
        await ready(client, timeout_s=30)
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def one(arrival: Arrival) -> tuple[int, dict[str, str]]:
            await asyncio.sleep(max(0.0, started + arrival.at - loop.time()))
            body = {
                "model": EMBEDDED_MODEL_NAME,
                "prompt": arrival.prompt,
                "max_tokens": arrival.max_tokens,
                "priority": arrival.priority,
            }
            response = await client.post(COMPLETIONS, content=json.dumps(body))
            headers = {h: response.headers[h] for h in DECISION_HEADERS if h in response.headers}
            return response.status_code, headers

        return list(await asyncio.gather(*(one(arrival) for arrival in trace)))


def _offline(args: dict[str, Any], trace: list[Arrival]) -> list[tuple[int, dict[str, str]]]:
    cluster = OfflineCluster(_config({"pools": [{}], **args}))
    return [(outcome.status, outcome.headers) for outcome in cluster.run(trace)]


SHAPES: dict[str, dict[str, Any]] = {
    "pd": {
        "shape": "pd",
        "pools": [{"role": "prefill"}, {"role": "decode"}],
        "prefill_policy": {"name": "conditional", "prompt_length_threshold": 256},
    },
    "dp": {
        "shape": "dp",
        "pools": [{"replicas": 2}],
        "router": {"replica_choice": {"mixed": "prefix_affinity"}},
    },
    "auto": {"shape": "auto", "pools": [{"replicas": 2}]},
}


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_a_trace_gets_the_same_decisions_in_real_and_virtual_time(
    shape: str, tmp_path: Path
) -> None:
    args = _args(tmp_path, SHAPES[shape])
    trace = _trace()
    real = await _served(args, trace)
    offline = _offline(args, trace)
    differing = [
        (arrival.index, served, simulated)
        for arrival, served, simulated in zip(trace, real, offline, strict=True)
        if served != simulated
    ]
    assert not differing, f"{len(differing)} of {len(trace)} decisions differ: {differing}"
    # The trace decides something: some requests were shed, and prompts ran in more
    # than one place.
    statuses = [status for status, _ in real]
    assert 200 in statuses and 503 in statuses
    assert len({json.dumps(headers, sort_keys=True) for _, headers in real}) > 1
