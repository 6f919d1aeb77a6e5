"""Client-side helpers for tests of pools that Serve grows and shrinks."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from deployments.launcher import RunningApp
from engines.tiny_model import EMBEDDED_MODEL_NAME
from tests.support.synthetic_apps import synthetic_dp
from tests.support.waiting import eventually


@contextlib.contextmanager
def scaled_synthetic_pool(
    folder: Path, routers: int, engine: dict[str, Any], scaling: dict[str, Any]
) -> Iterator[RunningApp]:
    """One pool of synthetic engines that Serve scales (``scaling``: the pool's
    ``autoscaling`` block), starting from one engine, behind ``routers`` routers."""
    pool = {"role": "mixed", "replicas": 1, "autoscaling": scaling}
    with synthetic_dp(folder, routers, engine, pool=pool) as app:
        yield app


def members(url: str) -> set[str]:
    """The engines this router routes to (its /health lists them, 200 or 503)."""
    return set(httpx.get(f"{url}/health", timeout=10).json()["replicas"])


def complete(url: str, max_tokens: int) -> httpx.Response:
    body = {"model": EMBEDDED_MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": max_tokens}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def shrink_under_streams(
    stream: Callable[[dict[str, Any]], None],
    engines: Callable[[], set[str]],
    timeout_s: float,
    stagger_s: float,
) -> list[dict[str, Any]]:
    """One long stream on each of a pool's two engines while the pool shrinks to one
    under them; the streams' results once they end.

    ``stream`` fills its dict with the ``replica`` that serves it and the monotonic
    ``ended_at``; ``engines`` lists the pool's engines as a router sees them. Checks that
    each engine carried a stream and that the one taken out still streamed after it
    left the pool (it drained, rather than being stopped)."""
    before = engines()
    streams: list[dict[str, Any]] = [{} for _ in before]
    threads = [threading.Thread(target=stream, args=(result,)) for result in streams]
    for thread in threads:
        thread.start()
        time.sleep(stagger_s)
    eventually(lambda: len(engines()) == 1, timeout_s)
    shrunk_at = time.monotonic()
    for thread in threads:
        thread.join(timeout=timeout_s)
    (removed,) = before - engines()
    assert {result["replica"] for result in streams} == before
    drained = next(result for result in streams if result["replica"] == removed)
    assert drained["ended_at"] > shrunk_at, "the engine left the pool while it streamed"
    return streams
