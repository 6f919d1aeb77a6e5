"""The engine replicas the router can send to, with its own in-flight counts."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(slots=True)
class Replica:
    name: str
    role: str
    handle: Any  # a Ray Serve DeploymentHandle to one EngineReplica deployment
    in_flight: int = 0


class ReplicaChoice(Protocol):
    def choose(self, replicas: list[Replica]) -> Replica: ...


class RoundRobin:
    """The study's DP: each replica takes every n-th request and keeps its own queue."""

    def __init__(self) -> None:
        self._counter: Iterator[int] = itertools.count()

    def choose(self, replicas: list[Replica]) -> Replica:
        if not replicas:
            raise LookupError("no replica to choose from")
        return replicas[next(self._counter) % len(replicas)]


def make_replica_choice(name: str) -> ReplicaChoice:
    choices = {"round_robin": RoundRobin}
    if name not in choices:
        raise ValueError(f"unknown replica_choice {name!r}; choose one of {sorted(choices)}")
    return choices[name]()
