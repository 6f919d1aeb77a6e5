"""The built-in engine choices (see router/policies/engine_choice.py): round_robin,
least_loaded, prefix_affinity.

Each also chooses from the pool's ``EngineIndex`` (``choose_from``): the same rule read
from indexes kept as loads change, in what a decision costs at any fleet size; the
dispatcher uses it wherever every healthy engine of the role is a candidate (a request
without an adapter, the common case), ``choose`` where it must narrow them first.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

from pydantic import Field

from router.policies.engine_choice import ENGINE_CHOICES, Choice
from splitserve.config_base import StrictModel

if TYPE_CHECKING:
    from router.pool.engine_index import EngineIndex
    from router.pool.pooled_engine import PooledEngine
    from router.pool.prefix_index import PromptBlocks


@ENGINE_CHOICES.register("round_robin")
class RoundRobin:
    """The study's DP: each engine takes every n-th request and keeps its own queue."""

    settings_model: ClassVar[type[StrictModel]] = StrictModel

    def __init__(self, settings: StrictModel | None = None) -> None:
        self._counter: Iterator[int] = itertools.count()

    def choose(self, engines: list[PooledEngine], prompt: PromptBlocks) -> Choice:
        _require(engines)
        return Choice(engines[next(self._counter) % len(engines)], "round_robin")

    def choose_from(self, index: EngineIndex, role: str, prompt: PromptBlocks) -> Choice | None:
        healthy = index.healthy(role)
        return self.choose(healthy, prompt) if healthy else None


@ENGINE_CHOICES.register("least_loaded")
class LeastLoaded:
    """Fewest active requests (the router's or the engine's count, whichever is larger;
    for a prefill engine, queued prefills), then the emptier KV cache; equal engines
    take turns."""

    settings_model: ClassVar[type[StrictModel]] = StrictModel

    def __init__(self, settings: StrictModel | None = None) -> None:
        self._counter: Iterator[int] = itertools.count()

    def choose(self, engines: list[PooledEngine], prompt: PromptBlocks) -> Choice:
        _require(engines)
        return Choice(self.pick(engines), "least_loaded")

    def pick(self, engines: list[PooledEngine]) -> PooledEngine:
        loads = [_load(r) for r in engines]  # each read once: it is per request, per engine
        lightest = min(loads)
        tied = [r for r, load in zip(engines, loads, strict=True) if load == lightest]
        return tied[next(self._counter) % len(tied)]

    def choose_from(self, index: EngineIndex, role: str, prompt: PromptBlocks) -> Choice | None:
        """Of equals, the one chosen longest ago (where ``choose`` takes equals in turn)."""
        engine = index.least_loaded(role)
        return None if engine is None else Choice(engine, "least_loaded")


class PrefixAffinitySettings(StrictModel):
    max_load_imbalance: int = Field(
        4,
        ge=0,
        description="Requests a engine may carry beyond the least loaded one before a"
        " prefix hit stops pulling traffic to it (one hot prefix must not pin one engine).",
    )
    min_hit_tokens: int = Field(1, ge=1, description="Shorter estimated hits count as no hit.")


@ENGINE_CHOICES.register("prefix_affinity")
class PrefixAffinity:
    """The engine expected to hold the longest prefix of the prompt, unless it carries
    more than ``max_load_imbalance`` requests beyond the least loaded engine: then the
    least loaded takes it, so one hot prefix cannot pin all its traffic to one engine."""

    settings_model: ClassVar[type[StrictModel]] = PrefixAffinitySettings

    def __init__(self, settings: StrictModel | None = None) -> None:
        self._config = (
            settings if isinstance(settings, PrefixAffinitySettings) else PrefixAffinitySettings()
        )
        self._fallback = LeastLoaded()

    def choose(self, engines: list[PooledEngine], prompt: PromptBlocks) -> Choice:
        _require(engines)
        hits = {r.name: r.state.cached_tokens(prompt) for r in engines}
        best = max(engines, key=lambda r: (hits[r.name], -_requests(r)))
        if hits[best.name] < self._config.min_hit_tokens:
            return Choice(self._fallback.pick(engines), "no_prefix_hit")
        least = min(_requests(r) for r in engines)
        if _requests(best) - least > self._config.max_load_imbalance:
            return Choice(self._fallback.pick(engines), "load_guard")
        return Choice(best, "prefix_hit")

    def choose_from(self, index: EngineIndex, role: str, prompt: PromptBlocks) -> Choice | None:
        """The rule of ``choose``, with the hits found from the prompt's blocks
        (``EngineIndex.cached_tokens``) and the least load from the index."""
        hits = index.cached_tokens(role, prompt)
        best = max(hits, key=lambda e: (hits[e], -_requests(e)), default=None)
        if best is None or hits[best] < self._config.min_hit_tokens:
            least = index.least_loaded(role)
            return None if least is None else Choice(least, "no_prefix_hit")
        least_requests = index.least_requests(role)
        if (
            least_requests is not None
            and _requests(best) - least_requests > self._config.max_load_imbalance
        ):
            least = index.least_loaded(role)
            return None if least is None else Choice(least, "load_guard")
        return Choice(best, "prefix_hit")


def _requests(engine: PooledEngine) -> int:
    # A prefill engine is busy with prefills only; the decodes its requests go on to
    # elsewhere would make it look loaded for their whole length.
    state = engine.state
    return state.prefill_queue if engine.role == "prefill" else state.active


def _load(engine: PooledEngine) -> tuple[int, float]:
    return _requests(engine), engine.state.kv_cache_usage


def _require(engines: list[PooledEngine]) -> None:
    if not engines:
        raise LookupError("no engine to choose from")
