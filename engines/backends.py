"""Engine backends by name (``engine.backend`` in the YAML): the class that hosts one
engine and speaks the router's protocol (``engines.protocol``). Built in: ``vllm``
(``engines.host.EngineHost``), ``simulated`` (``engines.simulated.host``: vLLM's
scheduling on a latency profile's time) and ``synthetic`` (``engines.synthetic``: tokens
as fast as steps allow). A new backend implements ``EngineBackend`` and is registered
with ``@ENGINE_BACKENDS.register("name")``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engines.protocol import DeltaBatch, EngineStats, GenerateRequest, LoraAdapter
from splitserve.registry import Registry

if TYPE_CHECKING:
    from engines.settings import EngineSpec


@runtime_checkable
class EngineBackend(Protocol):
    """The one engine contract: what the router's links and the engine transport call."""

    def __init__(self, spec: EngineSpec) -> None: ...

    async def submit(self, request: GenerateRequest) -> None:
        """Start a request; its deltas go to its subscriber's stream."""

    async def abort(self, request_id: str) -> None:
        """Stop a request (its client went away)."""

    def deltas(self, subscriber: str) -> AsyncIterator[DeltaBatch]:
        """One long-lived stream per router process: every delta of its requests, by step."""

    def stats(self) -> EngineStats: ...

    async def check_health(self) -> None:
        """Raise if the engine cannot serve."""

    async def add_lora(self, adapter: LoraAdapter) -> None: ...

    async def remove_lora(self, adapter: LoraAdapter) -> None: ...

    def close_streams(self) -> None:
        """End every ``deltas`` stream after what is queued (the host is being replaced)."""

    @property
    def dead(self) -> bool:
        """The engine failed for good: only a new host serves."""

    def shutdown(self) -> None: ...


ENGINE_BACKENDS: Registry[type[EngineBackend]] = Registry(
    "engine backend",
    __name__,
    builtins=("engines.host", "engines.synthetic", "engines.simulated.host"),
)
