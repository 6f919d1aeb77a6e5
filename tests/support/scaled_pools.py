"""Client-side helpers for tests of pools that Serve grows and shrinks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from deployments.launcher import RunningApp
from engines.tiny_model import EMBEDDED_MODEL_NAME
from tests.support.synthetic_apps import synthetic_dp


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
