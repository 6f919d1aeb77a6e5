"""Client-side helpers for tests of pools that Serve grows and shrinks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from engines.tiny_model import EMBEDDED_MODEL_NAME
from tests.support.waiting import eventually


def members(url: str, model: str = EMBEDDED_MODEL_NAME) -> set[str]:
    """The engines this router routes to for ``model`` (its /health lists them, 200 or
    503: by model where it serves several)."""
    health = httpx.get(f"{url}/health", timeout=10).json()
    if "models" in health:
        return set(health["models"][model])
    return set(health["replicas"])


def complete(url: str, max_tokens: int, model: str = EMBEDDED_MODEL_NAME) -> httpx.Response:
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": max_tokens}
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
