"""An engine hosted in the router's process whose every start fails: the router says so
once, with the engine's reason, in the line the launcher stops on."""

from __future__ import annotations

import asyncio
import logging

import pytest

from engines.contract import EngineUnavailable
from router.pool.pooled_engine import LocalEngineLink
from splitserve.processes import ENGINE_CANNOT_START, SERVE_DEPLOY_FAILED

REASON = "To serve at least one request with the models's max seq len (4096), 2 GiB KV"
WAIT_S = 10


class _Unstartable:
    def __init__(self) -> None:
        self.starts = 0

    def __call__(self) -> None:
        self.starts += 1
        raise ValueError(REASON)


async def test_an_engine_that_never_starts_is_named_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    start = _Unstartable()
    link = LocalEngineLink("engine-0", start, restart_attempts=3)  # type: ignore[arg-type]
    with (
        caplog.at_level(logging.ERROR, logger="splitserve.router"),
        pytest.raises(EngineUnavailable, match="could not be started"),
    ):
        await asyncio.wait_for(link.wait_ready(), WAIT_S)
    assert start.starts == 3 and link.gave_up
    lines = [r.getMessage() for r in caplog.records if ENGINE_CANNOT_START in r.getMessage()]
    assert lines == [f"{ENGINE_CANNOT_START}: engine-0 failed all 3 starts: ValueError: {REASON}"]
    assert ENGINE_CANNOT_START in SERVE_DEPLOY_FAILED  # the launcher stops on that line
