"""How the router picks one engine replica of a pool for a request.

Every policy gets only healthy replicas and the prompt's block hashes, and says why it
chose as it did (the ``reason`` label of ``splitserve_replica_choices_total``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import NamedTuple, Protocol

from router.engine_client import EngineClient
from router.prefix_index import PromptBlocks
from router.settings import PrefixAffinityConfig, ReplicaChoiceName


class Choice(NamedTuple):
    replica: EngineClient
    reason: str


class ReplicaChoice(Protocol):
    name: ReplicaChoiceName

    def choose(self, replicas: list[EngineClient], prompt: PromptBlocks) -> Choice: ...


class RoundRobin:
    """The study's DP: each replica takes every n-th request and keeps its own queue."""

    name: ReplicaChoiceName = "round_robin"

    def __init__(self) -> None:
        self._counter: Iterator[int] = itertools.count()

    def choose(self, replicas: list[EngineClient], prompt: PromptBlocks) -> Choice:
        _require(replicas)
        return Choice(replicas[next(self._counter) % len(replicas)], "round_robin")


class LeastLoaded:
    """Fewest active requests (the router's or the engine's count, whichever is larger;
    for a prefill replica, queued prefills), then the emptier KV cache; equal replicas
    take turns."""

    name: ReplicaChoiceName = "least_loaded"

    def __init__(self) -> None:
        self._counter: Iterator[int] = itertools.count()

    def choose(self, replicas: list[EngineClient], prompt: PromptBlocks) -> Choice:
        _require(replicas)
        return Choice(self.pick(replicas), "least_loaded")

    def pick(self, replicas: list[EngineClient]) -> EngineClient:
        lightest = min(_load(r) for r in replicas)
        tied = [r for r in replicas if _load(r) == lightest]
        return tied[next(self._counter) % len(tied)]


class PrefixAffinity:
    """The replica expected to hold the longest prefix of the prompt, unless it carries
    more than ``max_load_imbalance`` requests beyond the least loaded replica: then the
    least loaded takes it, so one hot prefix cannot pin all its traffic to one replica."""

    name: ReplicaChoiceName = "prefix_affinity"

    def __init__(self, config: PrefixAffinityConfig) -> None:
        self._config = config
        self._fallback = LeastLoaded()

    def choose(self, replicas: list[EngineClient], prompt: PromptBlocks) -> Choice:
        _require(replicas)
        hits = {r.name: r.state.cached_tokens(prompt) for r in replicas}
        best = max(replicas, key=lambda r: (hits[r.name], -_requests(r)))
        if hits[best.name] < self._config.min_hit_tokens:
            return Choice(self._fallback.pick(replicas), "no_prefix_hit")
        least = min(_requests(r) for r in replicas)
        if _requests(best) - least > self._config.max_load_imbalance:
            return Choice(self._fallback.pick(replicas), "load_guard")
        return Choice(best, "prefix_hit")


def _requests(replica: EngineClient) -> int:
    # A prefill replica is busy with prefills only; the decodes its requests go on to
    # elsewhere would make it look loaded for their whole length.
    state = replica.state
    return state.prefill_queue if replica.role == "prefill" else state.active


def _load(replica: EngineClient) -> tuple[int, float]:
    return _requests(replica), replica.state.kv_cache_usage


def _require(replicas: list[EngineClient]) -> None:
    if not replicas:
        raise LookupError("no replica to choose from")


def make_replica_choice(
    name: ReplicaChoiceName, prefix_affinity: PrefixAffinityConfig
) -> ReplicaChoice:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_affinity":
        return PrefixAffinity(prefix_affinity)
    raise ValueError(
        f"unknown replica_choice {name!r}; choose round_robin, least_loaded or prefix_affinity"
    )
