"""Which asyncio event loop the load generator and its fake server run on."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_event_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop when it is installed (uvicorn[standard] brings it).

    uvloop roughly halves the event loop's own cost per request, which is what limits
    the send rate of a Python client.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)
