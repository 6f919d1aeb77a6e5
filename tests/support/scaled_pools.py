"""Client-side helpers for tests of pools that Serve grows and shrinks."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from engines.tiny_model import EMBEDDED_MODEL_NAME


def members(url: str) -> set[str]:
    """The engines this router routes to (its /health lists them, 200 or 503)."""
    return set(httpx.get(f"{url}/health", timeout=10).json()["replicas"])


def eventually(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.25)


def complete(url: str, max_tokens: int) -> httpx.Response:
    body = {"model": EMBEDDED_MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": max_tokens}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)
