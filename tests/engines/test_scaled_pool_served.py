"""A pool that follows the load (``pools[].autoscaling``): Ray Serve grows it from the
SLO measurements its engines report, every router starts using the new engine, and
when the load is gone Serve shrinks it while the engine it takes out is still
streaming: that stream finishes whole.

Synthetic engines with a batch cap of two (``max_num_seqs``) make a queue, and so a
long time to first token, from a handful of requests; the model does not matter here.
The ``scaled`` model of the model-free served tests' shared application
(tests/support/shared_apps.py: ``SCALED_TO_TWO``).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from deployments.launcher import RunningApp
from tests.support.scaled_pools import (
    complete,
    members,
    shrink_under_streams,
)
from tests.support.shared_apps import synthetic_models
from tests.support.waiting import eventually

pytestmark = pytest.mark.serving

SCALED = synthetic_models(Path())["scaled"]
# Six requests of 100 tokens on one engine serving two at a time: three waves of about
# a second each, so the last wave waits two seconds for its first token.
BURST = 6
BURST_TOKENS = 100
# About 30 s at one token per step: the pool shrinks long before these end.
LONG_STREAM_TOKENS = 3000
SCALE_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def scaled_pool(model_free_app: RunningApp) -> RunningApp:
    return model_free_app


def _burst_until(url: str, done: threading.Event) -> list[httpx.Response]:
    answers: list[httpx.Response] = []
    with ThreadPoolExecutor(BURST) as pool:
        while not done.is_set():
            answers.extend(
                pool.map(lambda _: complete(url, BURST_TOKENS, SCALED.name), range(BURST))
            )
    return answers


def _stream(url: str, result: dict[str, Any]) -> None:
    body = {
        "model": SCALED.name,
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
    assert len(members(url, SCALED.name)) == 1

    # A queue forms on the one engine: Serve adds the second, and every router uses it.
    grown = threading.Event()
    with ThreadPoolExecutor(1) as load:
        answers = load.submit(_burst_until, url, grown)
        try:
            eventually(
                lambda: all(len(members(u, SCALED.name)) == 2 for u in scaled_pool.router_urls),
                SCALE_TIMEOUT_S,
            )
        finally:
            grown.set()
        burst = answers.result()
    assert {a.status_code for a in burst} == {200}
    assert {a.json()["usage"]["completion_tokens"] for a in burst} == {BURST_TOKENS}
    engines = members(url, SCALED.name)
    seen = {complete(url, 1, SCALED.name).headers["x-splitserve-replica"] for _ in range(4)}
    assert seen == engines, "the new engine takes requests once Serve runs it"

    # One long stream on each engine; with the queue gone, the pool shrinks under them.
    streams = shrink_under_streams(
        lambda result: _stream(url, result), lambda: members(url, SCALED.name), SCALE_TIMEOUT_S, 0.2
    )
    for stream in streams:
        # A relay that falls behind joins tokens into one event: count the tokens.
        assert stream["errors"] == [] and stream["tokens"] == LONG_STREAM_TOKENS
        assert stream["usage"]["completion_tokens"] == LONG_STREAM_TOKENS
    assert complete(url, 4, SCALED.name).status_code == 200
