"""The engine side of the router protocol's delta stream: one outbox per subscriber
(router process), read as one stream of batches, so a message carries one engine step
of many requests instead of one token of one request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from engines.protocol import DeltaBatch

# One subscriber's queue of (request id, delta); None ends its stream.
Outbox = asyncio.Queue[tuple[str, Any] | None]


class DeltaStreams:
    """Each subscriber's outbox of (request id, delta), read as one stream of batches."""

    def __init__(self) -> None:
        self._outboxes: dict[str, Outbox] = {}

    def outbox(self, subscriber: str) -> Outbox:
        # Called once per token: build a queue only for a subscriber that has none.
        outbox = self._outboxes.get(subscriber)
        if outbox is None:
            outbox = self._outboxes[subscriber] = asyncio.Queue()
        return outbox

    async def stream(
        self, subscriber: str, on_gone: Callable[[str], None]
    ) -> AsyncIterator[DeltaBatch]:
        """Every delta ready since the last item, until ``close_all``; ``on_gone`` runs
        when the subscriber stops reading, for the requests it left behind."""
        outbox = self.outbox(subscriber)
        try:
            while True:
                items = [await outbox.get()]
                while not outbox.empty():
                    items.append(outbox.get_nowait())
                batch = [item for item in items if item is not None]
                if batch:
                    yield batch
                if len(batch) < len(items):
                    return  # close_all: the host is being replaced
        finally:
            on_gone(subscriber)
            self._outboxes.pop(subscriber, None)

    def broadcast(self, item: tuple[str, Any]) -> None:
        """The same item to every subscriber (a change every router must see)."""
        for outbox in self._outboxes.values():
            outbox.put_nowait(item)

    def close_all(self) -> None:
        """End every stream after what is queued, so subscribers move on."""
        for outbox in self._outboxes.values():
            outbox.put_nowait(None)
