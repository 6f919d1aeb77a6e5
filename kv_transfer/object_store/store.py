"""Where the connector's worker half puts and gets KV parts: Ray's object store.

A seam of two calls, so the worker half runs in the fast tests without a Ray cluster
(tests/support/kv_doubles.py puts parts in a dict); everything real goes through Ray.
"""

from __future__ import annotations

from typing import Any, Protocol

import ray


class ObjectStore(Protocol):
    def put(self, value: Any) -> Any:
        """Store ``value``; return the reference that ``get`` and the directory take."""

    def get(self, ref: Any, timeout_s: float | None = None) -> Any:
        """The value of a reference (an object, or an actor call's answer)."""


class RayObjectStore:
    """``ray.put`` copies the pages into shared memory once; ``ray.get`` on the same
    node returns read-only arrays backed by it (zero copy)."""

    def put(self, value: Any) -> Any:
        return ray.put(value)

    def get(self, ref: Any, timeout_s: float | None = None) -> Any:
        return ray.get(ref, timeout=timeout_s)
