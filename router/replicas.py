"""How the router picks one engine replica of a pool for a request."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Protocol

from router.engine_client import EngineClient


class ReplicaChoice(Protocol):
    def choose(self, replicas: list[EngineClient]) -> EngineClient: ...


class RoundRobin:
    """The study's DP: each replica takes every n-th request and keeps its own queue."""

    def __init__(self) -> None:
        self._counter: Iterator[int] = itertools.count()

    def choose(self, replicas: list[EngineClient]) -> EngineClient:
        if not replicas:
            raise LookupError("no replica to choose from")
        return replicas[next(self._counter) % len(replicas)]


def make_replica_choice(name: str) -> ReplicaChoice:
    choices = {"round_robin": RoundRobin}
    if name not in choices:
        raise ValueError(f"unknown replica_choice {name!r}; choose one of {sorted(choices)}")
    return choices[name]()
