"""Simulated engines behind the router, in this process: every shape answers, the time
each step takes is the profile's, PD's decode engine waits for the hand-over, and the
prefix cache reaches the router's index through KV events."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from deployments.config import parse_app_config
from engines.simulated.host import SimulatedEngineHost
from engines.tiny_model import EMBEDDED_MODEL_NAME
from router.pool.pooled_engine import LocalEngineLink
from tests.support.in_process_router import (
    COMPLETIONS,
    http_client,
    in_process_router,
    only_model,
    ready,
    until,
)
from tests.support.processes import TICKS_PER_S, alive, cpu_seconds
from tests.support.simulated import round_profile

# Steps of tens of milliseconds: long beside this loop's own delays, short for a test.
STEP_S = 0.02
PROMPT = "x" * 200  # 200 byte tokens (plus BOS) with the embedded tokenizer


def _host(router: Any, name: str) -> SimulatedEngineHost:
    """The simulated engine the in-process router hosts as ``name``."""
    link = only_model(router).pool.get(name).link
    assert isinstance(link, LocalEngineLink) and isinstance(link._host, SimulatedEngineHost)
    return link._host


def _profile(tmp_path: Path, **fields: Any) -> str:
    return round_profile(
        tmp_path,
        STEP_S,
        compute_per_token_s=0.0001,
        handover_bytes_per_s=1000 * 1000,  # 1 ms per token of KV: 0.2 s for the prompt
        **fields,
    )


def _engine(tmp_path: Path) -> dict[str, Any]:
    return {"backend": "simulated", "profile": _profile(tmp_path)}


def _pd_always(engine: dict[str, Any], **fields: Any) -> Any:
    """A router over one prefill and one decode engine, every prompt handed over."""
    pools = [{"role": "prefill"}, {"role": "decode"}]
    split = {"name": "always"}
    return in_process_router(shape="pd", pools=pools, engine=engine, prefill_policy=split, **fields)


async def _complete(client: Any, max_tokens: int = 5, **fields: Any) -> tuple[float, Any]:
    body = {"model": EMBEDDED_MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, **fields}
    started = asyncio.get_running_loop().time()
    response = await client.post(COMPLETIONS, content=json.dumps(body))
    assert response.status_code == 200, response.text
    return asyncio.get_running_loop().time() - started, response


@pytest.mark.parametrize(
    "shape",
    [
        {"shape": "single", "pools": [{}]},
        {"shape": "dp", "pools": [{"replicas": 2}]},
        {"shape": "pd", "pools": [{"role": "prefill"}, {"role": "decode"}]},
        {"shape": "auto", "pools": [{"replicas": 2}]},
    ],
    ids=["single", "dp", "pd", "auto"],
)
async def test_every_shape_serves_on_simulated_engines(
    shape: dict[str, Any], tmp_path: Path
) -> None:
    async with in_process_router(**shape, engine=_engine(tmp_path)) as router:
        async with http_client(router) as client:
            await ready(client, timeout_s=20)
            _, response = await _complete(client, max_tokens=5)
            body = response.json()
            assert body["usage"]["completion_tokens"] == 5
            assert body["choices"][0]["finish_reason"] == "length"
        assert only_model(router).pool  # the router kept its engines


async def test_a_request_takes_the_profiles_steps(tmp_path: Path) -> None:
    """Prefill and 9 decode steps of STEP_S and a little per token: never faster than the
    profile, and not much slower."""
    engine = _engine(tmp_path)
    async with in_process_router(engine=engine) as router, http_client(router) as client:
        await ready(client, timeout_s=20)
        elapsed, _ = await _complete(client, max_tokens=10)
    expected = 10 * STEP_S + 0.0001 * (201 + 9)
    assert expected <= elapsed < expected * 1.5 + 0.1


async def test_time_scale_stretches_every_step(tmp_path: Path) -> None:
    engine = {**_engine(tmp_path), "time_scale": 3.0}
    async with in_process_router(engine=engine) as router, http_client(router) as client:
        await ready(client, timeout_s=20)
        elapsed, _ = await _complete(client, max_tokens=5)
    assert elapsed >= 3 * 5 * STEP_S


async def test_spend_cpu_computes_each_step_on_the_engines_cores(tmp_path: Path) -> None:
    """With engine.spend: cpu the profile's step times are CPU time of a child process
    bound to the engine's cores (cpu_binds), which ends with the engine."""
    engine = {**_engine(tmp_path), "spend": "cpu"}
    async with (
        in_process_router(engine=engine, pools=[{"cpu_binds": ["0"]}]) as router,
        http_client(router) as client,
    ):
        await ready(client, timeout_s=20)
        host = _host(router, "engine-0")
        elapsed, _ = await _complete(client, max_tokens=10)
        assert host._spender is not None
        pid = host._spender.pid
        assert pid is not None
        assert os.sched_getaffinity(pid) == {0}
        spent = cpu_seconds(pid)
    expected = 10 * STEP_S + 0.0001 * (201 + 9)
    assert spent >= expected - 2 / TICKS_PER_S
    assert elapsed >= expected
    await until(lambda: not alive(pid), timeout_s=5)


async def test_pd_decode_waits_for_the_hand_over_of_the_prompts_kv(tmp_path: Path) -> None:
    pools = [{"role": "prefill"}, {"role": "decode"}]
    split = {"name": "always"}
    engine = _engine(tmp_path)
    async with in_process_router(
        shape="pd", pools=pools, engine=engine, prefill_policy=split
    ) as router:
        async with http_client(router) as client:
            await ready(client, timeout_s=20)
            decode = _host(router, "decode-0")
            before = decode.stats().prompt_tokens  # the router's calibration computed some
            elapsed, response = await _complete(client, max_tokens=3)
            assert response.headers["x-splitserve-prefill"] == "remote:always"
        after = decode.stats().prompt_tokens
        added = {source: after[source] - before[source] for source in after}
        # Every prompt token's KV arrived but the last, which the decode engine computes.
        prompt_tokens = response.json()["usage"]["prompt_tokens"]
        assert added == {
            "local_compute": 1,
            "local_cache_hit": 0,
            "external_kv_transfer": prompt_tokens - 1,
        }
    # 0.2 s of hand-over for 200 tokens of KV (the last one is computed again).
    assert elapsed >= 0.2 + 3 * STEP_S


async def test_spend_cpu_computes_a_hand_overs_host_work_before_the_kv_is_in(
    tmp_path: Path,
) -> None:
    """With engine.spend: cpu the profile's handover_cpu_s is CPU time of a child of the
    decode engine's host, after the link and before the request may compute."""
    engine = {"backend": "simulated", "spend": "cpu"}
    engine["profile"] = _profile(tmp_path, handover_cpu_s=0.1)
    async with _pd_always(engine) as router, http_client(router) as client:
        await ready(client, timeout_s=20)
        decode = _host(router, "decode-0")
        elapsed, _ = await _complete(client, max_tokens=3)
        assert decode._handover_spender is not None
        pid = decode._handover_spender.pid
        assert pid is not None
        spent = cpu_seconds(pid)
    assert spent >= 0.1 - 2 / TICKS_PER_S
    # The link's 0.2 s, then the host's 0.1 s, then the load and the decode steps.
    assert elapsed >= 0.2 + 0.1 + 3 * STEP_S
    await until(lambda: not alive(pid), timeout_s=5)


async def test_a_hand_over_reaches_the_routers_cost_meter_as_a_real_engines_does(
    tmp_path: Path,
) -> None:
    """The decode engine counts each hand-over's bytes and link time where a vLLM
    engine's connector would, and the router's cost policy learns the link from them."""
    engine = _engine(tmp_path)
    router_settings = {"stats_interval_s": 0.05, "kv_metrics_interval_s": 0.1}
    async with (
        _pd_always(engine, router=router_settings) as router,
        http_client(router) as client,
    ):
        await ready(client, timeout_s=20)
        model = only_model(router)
        host = _host(router, "decode-0")
        meter = model.stats_poller.transfer_cost
        _, response = await _complete(client, max_tokens=2)
        # The meter's first reading, with the first hand-over: the next one gives a sample.
        await until(lambda: meter._last is not None, timeout_s=5)
        _, response = await _complete(client, max_tokens=2)
        transfers = host.stats().kv_transfer
        assert transfers is not None
        await until(lambda: meter.estimate_s(1) is not None, timeout_s=5)
    tokens = response.json()["usage"]["prompt_tokens"]
    assert transfers["handovers"] == {"put": 0, "get": 2}
    assert transfers["bytes"]["get"] == 2 * tokens * 1000
    assert transfers["seconds_sum"]["get"] == pytest.approx(
        2 * host.profile.handover_seconds(tokens)
    )
    # Seconds per prompt token whose KV was handed over (all of it but the last token).
    estimate = meter.estimate_s(tokens - 1)
    assert estimate == pytest.approx(host.profile.handover_seconds(tokens), rel=1e-6)


async def test_the_prefix_cache_reaches_the_router_through_kv_events(tmp_path: Path) -> None:
    router_settings = {"prefix_signal": "kv_events"}
    async with in_process_router(engine=_engine(tmp_path), router=router_settings) as router:
        async with http_client(router) as client:
            await ready(client, timeout_s=20)
            await _complete(client, max_tokens=2)
            _, response = await _complete(client, max_tokens=2)
            assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        host = _host(router, "engine-0")
        assert host.stats().prefix_cache_hits > 0


def test_a_profile_for_other_parallel_degrees_is_refused(tmp_path: Path) -> None:
    args = {
        "shape": "tp",
        "pools": [{"tensor_parallel_size": 2}],
        "engine": _engine(tmp_path),
    }
    with pytest.raises(ValueError, match="is for TP 1 x PP 1, but the pool runs TP 2 x PP 1"):
        parse_app_config(args)


def test_simulated_engines_need_a_profile() -> None:
    with pytest.raises(ValueError, match=r"needs engine\.profile"):
        parse_app_config({"shape": "single", "engine": {"backend": "simulated"}})
