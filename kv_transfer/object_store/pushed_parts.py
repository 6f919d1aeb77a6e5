"""A decode rank's standing ``deliveries`` call: parts pushed to it, fetched ahead.

The router names the decode engine when it sends a prompt to prefill, so the directory
can hand this rank its part while the first token is still on its way to the client.
A thread keeps one ``deliveries`` call open at a time, gets each pushed part from the
object store as soon as it arrives (zero copy on the same node) and keeps it until the
load takes it, or until the directory says the transfer closed (released, expired,
loaded through a claim), whichever comes first.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from kv_transfer.object_store.paged_cache import PackedLayers
from kv_transfer.object_store.store import ObjectStore, RayObjectStore

logger = logging.getLogger("vllm.splitserve.kv_transfer")

# How long one deliveries call waits for a push before it returns empty.
POLL_S = 1.0
# After a failed call (directory restarting, Ray going down) the next one waits this long.
RETRY_S = 1.0
# A directory that does not answer must not block the thread forever.
ANSWER_TIMEOUT_S = 10.0


@dataclass(slots=True)
class FetchedPart:
    """One part in this process (views of the object store's copy), and its fetch time."""

    ref: Any  # kept while the views live: the object must not be freed under them
    packed: PackedLayers
    layout: dict[str, Any]
    get_seconds: float


class PushedParts:
    def __init__(
        self,
        directory: Any,
        consumer: str,
        rank: int,
        get_timeout_s: float,
        store: ObjectStore | None = None,
    ) -> None:
        self._directory = directory
        self._store: ObjectStore = store or RayObjectStore()
        self._consumer = consumer
        self._rank = rank
        self._get_timeout_s = get_timeout_s
        self._parts: dict[str, FetchedPart] = {}
        self._changed = threading.Condition()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-pushed", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        with self._changed:
            self._changed.notify_all()

    def take(self, transfer_id: str, wait_s: float) -> FetchedPart | None:
        """The part of ``transfer_id`` once it has arrived, or None after ``wait_s``."""
        with self._changed:
            self._changed.wait_for(
                lambda: transfer_id in self._parts or self._stopped.is_set(), timeout=wait_s
            )
            return self._parts.pop(transfer_id, None)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                # No local names for the answer here: one would keep the last part's
                # ref alive in this frame while the next call waits.
                self._take_in(self._next_deliveries())
            except Exception as error:
                if self._stopped.is_set():
                    return
                logger.debug("KV deliveries call failed (%s); retrying", error)
                self._stopped.wait(RETRY_S)

    def _next_deliveries(self) -> dict[str, Any]:
        with self._changed:
            held = list(self._parts)
        call = self._directory.deliveries.remote(self._consumer, self._rank, held, POLL_S)
        answer: dict[str, Any] = self._store.get(call, POLL_S + ANSWER_TIMEOUT_S)
        return answer

    def _take_in(self, answer: dict[str, Any]) -> None:
        self._drop(answer["closed"])
        for transfer_id, part in answer["parts"].items():
            self._fetch(transfer_id, part)

    def _fetch(self, transfer_id: str, part: dict[str, Any]) -> None:
        started = time.perf_counter()
        (ref,) = part["refs"]
        try:
            packed = self._store.get(ref, self._get_timeout_s)
        except Exception as error:
            # The load will wait in vain, then claim, and fail there with the reason.
            logger.warning("KV transfer %s: pushed part not fetched: %s", transfer_id, error)
            return
        fetched = FetchedPart(ref, packed, part["layout"], time.perf_counter() - started)
        with self._changed:
            self._parts[transfer_id] = fetched
            self._changed.notify_all()

    def _drop(self, transfer_ids: list[str]) -> None:
        with self._changed:
            for transfer_id in transfer_ids:
                self._parts.pop(transfer_id, None)
