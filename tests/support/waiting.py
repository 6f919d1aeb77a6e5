"""Waiting in tests for a served application to reach a state."""

from __future__ import annotations

import time
from collections.abc import Callable


def eventually(condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.25) -> None:
    """Until ``condition()`` holds; fails the test if it does not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(poll_s)
