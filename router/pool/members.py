"""Which replicas Ray Serve runs for each scaled pool, as this process last heard.

Serve tells every handle of a deployment when its running replicas change; a scaled
pool's request router (router/pool/membership.py) writes that here, and the router's
``PoolWatcher`` reads it. This is a module of its own because Serve ships the request
router's module to each process by value (a copy of its globals): state kept there
would not be the state the router reads.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_members: dict[str, tuple[str, ...]] = {}


def publish(deployment: str, replica_ids: list[str]) -> None:
    """Serve's current replicas of ``deployment`` (their unique ids)."""
    with _lock:
        _members[deployment] = tuple(sorted(replica_ids))


def members(deployment: str) -> tuple[str, ...] | None:
    """The replica ids last published for ``deployment``; None before Serve said any."""
    with _lock:
        return _members.get(deployment)
