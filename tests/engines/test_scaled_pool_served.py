"""A pool that follows the load (``pools[].autoscaling``): Ray Serve grows it from the
SLO measurements its engines report, every router starts using the new engine, and
when the load is gone Serve shrinks it while the engine it takes out is still
streaming: that stream finishes whole.

Synthetic engines with a batch cap of two (``max_num_seqs``) make a queue, and so a
long time to first token, from a handful of requests; the model does not matter here.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from deployments.launcher import RunningApp
from engines.tiny_model import EMBEDDED_MODEL_NAME
from tests.support.scaled_pools import (
    complete,
    members,
    scaled_synthetic_pool,
    shrink_under_streams,
)
from tests.support.waiting import eventually

pytestmark = pytest.mark.serving

ROUTERS = 2
STEP_INTERVAL_S = 0.01
ENGINE = {"backend": "synthetic", "step_interval_s": STEP_INTERVAL_S, "max_num_seqs": 2}
SCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    # A wait of a second for a first token is over the line; tokens every 10 ms are not.
    "ttft_slo_s": 1.0,
    "tpot_slo_s": 1.0,
    "upscale_delay_s": 0,
    "downscale_delay_s": 4,
    "window_s": 2,
    "drain_timeout_s": 90,
}
# Six requests of 100 tokens on one engine serving two at a time: three waves of about
# a second each, so the last wave waits two seconds for its first token.
BURST = 6
BURST_TOKENS = 100
# About 30 s at one token per step: the pool shrinks long before these end.
LONG_STREAM_TOKENS = 3000
SCALE_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def scaled_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningApp]:
    folder = tmp_path_factory.mktemp("scaled-pool")
    with scaled_synthetic_pool(folder, ROUTERS, ENGINE, SCALING) as app:
        yield app


def _burst_until(url: str, done: threading.Event) -> list[httpx.Response]:
    answers: list[httpx.Response] = []
    with ThreadPoolExecutor(BURST) as pool:
        while not done.is_set():
            answers.extend(pool.map(lambda _: complete(url, BURST_TOKENS), range(BURST)))
    return answers


def _stream(url: str, result: dict[str, Any]) -> None:
    body = {
        "model": EMBEDDED_MODEL_NAME,
        "prompt": [1, 2, 3],
        "max_tokens": LONG_STREAM_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    token_ids: list[int] = []
    errors: list[dict[str, Any]] = []
    usage: dict[str, int] = {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        result["replica"] = response.headers["x-splitserve-replica"]
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    errors.append(event)
                elif event.get("usage"):
                    usage = event["usage"]
                else:
                    for choice in event["choices"]:
                        token_ids.extend(choice["token_ids"])
    result.update(tokens=len(token_ids), usage=usage, errors=errors, ended_at=time.monotonic())


def test_the_pool_grows_under_load_and_shrinks_without_dropping_a_stream(
    scaled_pool: RunningApp,
) -> None:
    url = scaled_pool.base_url
    assert len(members(url)) == 1

    # A queue forms on the one engine: Serve adds the second, and every router uses it.
    grown = threading.Event()
    with ThreadPoolExecutor(1) as load:
        answers = load.submit(_burst_until, url, grown)
        try:
            eventually(
                lambda: all(len(members(u)) == 2 for u in scaled_pool.router_urls),
                SCALE_TIMEOUT_S,
            )
        finally:
            grown.set()
        burst = answers.result()
    assert {a.status_code for a in burst} == {200}
    assert {a.json()["usage"]["completion_tokens"] for a in burst} == {BURST_TOKENS}
    engines = members(url)
    seen = {complete(url, 1).headers["x-splitserve-replica"] for _ in range(4)}
    assert seen == engines, "the new engine takes requests once Serve runs it"

    # One long stream on each engine; with the queue gone, the pool shrinks under them.
    streams = shrink_under_streams(
        lambda result: _stream(url, result), lambda: members(url), SCALE_TIMEOUT_S, 0.2
    )
    for stream in streams:
        # A relay that falls behind joins tokens into one event: count the tokens.
        assert stream["errors"] == [] and stream["tokens"] == LONG_STREAM_TOKENS
        assert stream["usage"]["completion_tokens"] == LONG_STREAM_TOKENS
    assert complete(url, 4).status_code == 200
