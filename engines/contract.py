"""The one engine contract, seen from both sides.

``EngineBackend`` is what hosts an engine: every backend implements it, and the engine
transport serves one to the routers that connect (engines/transport.py).
``EngineLink`` is how a router reaches one: the same calls across a process boundary
(an engine replica over the transport, ``SocketEngineLink``) or within one (the
router's in-process host, router/pool/pooled_engine.py ``LocalEngineLink``), where
``stats`` is a round trip and ``abort`` is fire and forget. What a link raises when
the engine fails a request is ``EngineFailed``, or ``EngineUnavailable`` when it never
took it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from engines.protocol import DeltaBatch, EngineStats, GenerateRequest, LoraAdapter


@runtime_checkable
class EngineBackend(Protocol):
    """What every engine backend implements (``engines.host.EngineHost``, the
    synthetic and the simulated hosts), what the engine transport serves to routers, and
    what the router's in-process link calls. A backend is built from its ``EngineSpec``
    (``ENGINE_BACKENDS``)."""

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


class EngineLink(Protocol):
    """How the router reaches one engine: ``EngineBackend``'s calls as a client makes
    them, and whether the engine can take a request yet."""

    async def submit(self, request: GenerateRequest) -> None: ...

    def abort(self, request_id: str) -> None:
        """Fire and forget: the caller may be being torn down."""

    def deltas(self, subscriber: str) -> AsyncIterator[DeltaBatch]: ...

    async def stats(self) -> EngineStats: ...

    async def check_health(self) -> None: ...

    async def add_lora(self, adapter: LoraAdapter) -> None: ...

    async def remove_lora(self, adapter: LoraAdapter) -> None: ...

    async def wait_ready(self) -> None:
        """Return once the engine can take requests."""

    @property
    def ready(self) -> bool:
        """It could take a request now."""

    def shutdown(self) -> None:
        """Let go of what the link holds: an engine hosted in this process stops (and is
        not restarted); a connection to an engine replica of its own closes. Any thread."""


class EngineFailed(RuntimeError):
    """The engine replica failed the request or went away while it ran."""


class EngineUnavailable(EngineFailed):
    """The engine did not take the request (dead, restarting, or too slow to accept) or
    died under it: before a first token, the client may send it again as it is (503)."""
