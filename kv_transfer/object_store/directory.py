"""The directory: one Ray actor per namespace that knows every KV transfer in flight.

Ownership. Ray 2.56 removed ``ray.put(..., _owner=...)``, so an object is owned by the
process that puts it: the prefill engine's worker rank. That worker registers the
``ObjectRef`` here (the directory becomes a borrower) and drops its own reference, so
the directory alone decides how long the object lives; Ray frees it when the directory
and any decode worker reading it have let go. The price: an object dies with its
producer process. A decode engine then finds the transfer lost and recomputes the
prompt itself, which is also the behaviour we want when a prefill replica is gone.

Delivery. A decode worker gets a part's ref in one of two ways. Pushed: the router
names the decode engine when it sends the prompt to prefill, the producer registers
its part for that consumer, and the directory answers the consumer rank's standing
``deliveries`` call with it, so the ref (and the bytes, which the worker fetches at
once) is there before the decode request is; the load then costs only the writes into
the pages. Claimed: any other consumer asks with ``claim`` when it must load, one round
trip on the request's path (measured at 2-4 ms here, most of the old load time).

Lifetime. A transfer is closed, and its references dropped, when every part is loaded
(``loaded``), when ``ttl_s`` passes without that (``expired``; a claim restarts the
clock, so a slow load is not cut off), when a consumer reports it unusable (``failed``)
or when someone gives it up (``released``). A consumer rank that was pushed a part is
told in its next ``deliveries`` answer that the transfer closed, and drops its copy.
The directory keeps the ledger of those outcomes (``ledger_snapshot``); the bytes and
seconds of each put and load are the engines' own statistics (stats.py).

Engine processes are vLLM's multiprocessing children, not Ray workers; they join the
cluster as drivers through ``connect_ray``, at ``RAY_ADDRESS`` (vLLM sets it when its
engine is started from a Ray actor; a driver that starts engines must set it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import ray

from kv_transfer.handle import PARAMS_KEY
from kv_transfer.metrics import Ledger, Outcome
from kv_transfer.settings import DEFAULT_NAMESPACE

logger = logging.getLogger("splitserve.kv_transfer")

DIRECTORY_NAME = "splitserve-kv-directory"
SWEEP_INTERVAL_S = 0.5
# Closed transfer ids are remembered so that a late claim learns why, not just "unknown".
CLOSED_MEMORY = 10_000
# A consumer rank's inbox outlives its last deliveries call by this long (a restarted
# engine polls under a new id; its old inbox must not collect pushes forever).
INBOX_IDLE_S = 30.0

_connect_lock = threading.Lock()
_directories: dict[str, Any] = {}
_connected_here = False  # whether this process joined Ray through connect_ray


def connect_ray(namespace: str = DEFAULT_NAMESPACE) -> None:
    """Join the Ray cluster once per process; a process already in Ray keeps its connection."""
    global _connected_here
    with _connect_lock:
        if ray.is_initialized():
            return
        address = os.environ.get("RAY_ADDRESS")
        if not address:
            # Never "auto": with several clusters on one machine it picks the newest,
            # which may be someone else's, and the directory would be created there.
            raise RuntimeError(
                "the KV connector joins the Ray cluster named by RAY_ADDRESS, which is not "
                "set in this engine process (vLLM sets it when the engine runs in a Ray actor)"
            )
        in_main_thread = threading.current_thread() is threading.main_thread()
        # ray.init replaces the SIGTERM handler (and the excepthook); vLLM's engine
        # processes shut down through their own handler, so keep it.
        sigterm_handler = signal.getsignal(signal.SIGTERM) if in_main_thread else None
        excepthook = sys.excepthook
        try:
            ray.init(address=address, namespace=namespace, log_to_driver=False)
            _connected_here = True
            _stop_error_listener()
        except ConnectionError as error:
            raise RuntimeError(
                f"the KV connector found no Ray cluster at RAY_ADDRESS={address!r}"
            ) from error
        finally:
            if sigterm_handler is not None:
                signal.signal(signal.SIGTERM, sigterm_handler)
            sys.excepthook = excepthook


def _stop_error_listener() -> None:
    """End the thread ``ray.init`` starts in every driver to print cluster errors.

    In vLLM's worker processes (pinned to their cores) its GCS long poll returned at
    once, over and over: each idle engine worker spent 0.17 of a core on it and the GCS
    0.56 of one answering it (bench/kv_transfer.py's PD, docs/DECISIONS.md). An engine
    process has no console to print those errors to anyway.
    """
    worker = ray._private.worker.global_worker
    worker.threads_stopped.set()  # Ray's own stop signal for that thread; clears it on exit


def disconnect_ray() -> None:
    """Leave the cluster if connect_ray joined it, while vLLM tears the process down.

    vLLM gives an engine process a few seconds to exit after SIGTERM; disconnecting
    here keeps Ray's own exit hook from spending them.
    """
    global _connected_here
    with _connect_lock:
        if _connected_here:
            _directories.clear()
            ray.shutdown()
            _connected_here = False


def get_kv_directory(namespace: str = DEFAULT_NAMESPACE) -> Any:
    """The directory actor of ``namespace``, created on first use; it outlives its creator."""
    directory = _directories.get(namespace)
    if directory is None:
        connect_ray(namespace)
        directory = KVObjectDirectory.options(
            name=DIRECTORY_NAME,
            namespace=namespace,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            # Restarted empty if it dies: transfers in flight are recomputed, not stuck.
            max_restarts=-1,
        ).remote()
        _directories[namespace] = directory
    return directory


def release_handle(kv_transfer_params: dict[str, Any]) -> Any:
    """Free a transfer that will never be loaded (client gone between prefill and decode).

    Returns the ObjectRef of the call; awaiting it is optional.
    """
    fields = kv_transfer_params[PARAMS_KEY]
    directory = get_kv_directory(fields["namespace"])
    return directory.release.remote(fields["transfer_id"])


def shutdown_kv_directory(namespace: str = DEFAULT_NAMESPACE) -> None:
    """Kill the directory (it is detached); every transfer it holds is freed."""
    directory = _directories.pop(namespace, None)
    if directory is None:
        try:
            directory = ray.get_actor(DIRECTORY_NAME, namespace=namespace)
        except ValueError:
            return
    ray.kill(directory)


@dataclass
class _Part:
    """One producer rank's object."""

    ref: ray.ObjectRef | None
    nbytes: int
    layout: dict[str, Any]

    def handed_over(self) -> dict[str, Any]:
        """What a consumer rank gets, claimed or pushed (a list keeps the ref a ref)."""
        return {"refs": [self.ref], "nbytes": self.nbytes, "layout": self.layout}


@dataclass
class _Transfer:
    num_parts: int
    ttl_s: float
    deadline: float
    parts: dict[int, _Part] = field(default_factory=dict)
    loaded_ranks: set[int] = field(default_factory=set)
    # Consumer ranks (consumer id, rank) that were pushed a part and must hear it closed.
    pushed_to: set[tuple[str, int]] = field(default_factory=set)

    def live_bytes(self) -> int:
        return sum(part.nbytes for part in self.parts.values() if part.ref is not None)


@dataclass
class _Inbox:
    """Transfers pushed to one consumer rank and not yet handed over by ``deliveries``."""

    transfer_ids: list[str] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    polling: int = 0
    last_poll: float = field(default_factory=time.monotonic)


class TransferDirectory:
    """Maps transfer id → the object refs of its parts; frees them after use or TTL.

    Plain asyncio code: Ray runs it as the ``KVObjectDirectory`` actor, the fast tests
    run it in their own event loop (tests/support/kv_doubles.py).
    """

    def __init__(self) -> None:
        self._transfers: dict[str, _Transfer] = {}
        self._closed: OrderedDict[str, Outcome] = OrderedDict()
        self._ledger = Ledger()
        self._inboxes: dict[tuple[str, int], _Inbox] = {}
        # Set (and replaced) whenever a part is registered or a transfer closes: what
        # waiting claims wait for. Claims are the fallback path, so waking them all is cheap.
        self._registry_changed = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None

    async def register(
        self,
        transfer_id: str,
        rank: int,
        num_parts: int,
        refs: list[ray.ObjectRef],
        nbytes: int,
        layout: dict[str, Any],
        ttl_s: float,
        consumer: str | None = None,
    ) -> bool:
        """A producer rank's part is in the object store; False if the transfer is closed.

        ``consumer``: the decode engine the router chose, pushed the part if it polls.
        """
        self._ensure_sweeper()
        if transfer_id in self._closed:
            return False  # released before it was registered: let the object go at once
        transfer = self._transfers.get(transfer_id)
        if transfer is None:
            transfer = _Transfer(num_parts, ttl_s, time.monotonic() + ttl_s)
            self._transfers[transfer_id] = transfer
        # A list keeps the ref a ref: Ray resolves top-level ObjectRef arguments.
        transfer.parts[rank] = _Part(refs[0], nbytes, layout)
        self._announce_change()
        inbox = self._inboxes.get((consumer, rank)) if consumer else None
        if inbox is not None and consumer is not None:
            inbox.transfer_ids.append(transfer_id)
            inbox.changed.set()
            transfer.pushed_to.add((consumer, rank))
        return True

    async def deliveries(
        self, consumer: str, rank: int, held: list[str], wait_s: float
    ) -> dict[str, Any]:
        """A consumer rank's standing call: parts pushed to it, and which it may drop.

        Returns {"parts": {transfer_id: {"refs": [ref], "nbytes", "layout"}}, "closed":
        [ids of ``held`` no longer open]} as soon as either is non-empty, or empty after
        ``wait_s``. The first call opens the inbox; pushes before it are not delivered.
        """
        self._ensure_sweeper()
        inbox = self._inboxes.setdefault((consumer, rank), _Inbox())
        inbox.polling += 1
        try:
            deadline = time.monotonic() + wait_s
            while True:
                closed = [tid for tid in held if tid not in self._transfers]
                remaining = deadline - time.monotonic()
                if inbox.transfer_ids or closed or remaining <= 0:
                    break
                inbox.changed.clear()
                await _wait(inbox.changed, remaining)
            pushed, inbox.transfer_ids = inbox.transfer_ids, []
            return {"parts": self._parts_for(pushed, rank), "closed": closed}
        finally:
            inbox.polling -= 1
            inbox.last_poll = time.monotonic()

    def _parts_for(self, transfer_ids: list[str], rank: int) -> dict[str, Any]:
        parts = {}
        for transfer_id in transfer_ids:
            transfer = self._transfers.get(transfer_id)
            part = transfer.parts.get(rank) if transfer is not None else None
            if part is not None and part.ref is not None:
                parts[transfer_id] = part.handed_over()
        return parts

    async def claim(self, transfer_id: str, rank: int, wait_s: float) -> dict[str, Any]:
        """Hand a consumer rank its part: {"status": "ok", "refs": [ref], ...} or why not."""
        self._ensure_sweeper()
        deadline = time.monotonic() + wait_s
        while True:
            if transfer_id in self._closed:
                return {"status": self._closed[transfer_id]}
            transfer = self._transfers.get(transfer_id)
            part = transfer.parts.get(rank) if transfer is not None else None
            if part is not None and transfer is not None:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return {"status": "unknown"}
            # Registration is not awaited by the producer, so a claim can come first.
            await _wait(self._registry_changed, remaining)
        if part.ref is None:
            return {"status": "loaded"}
        # The load is under way: give it a full TTL, so only abandoned loads expire.
        transfer.deadline = max(transfer.deadline, time.monotonic() + transfer.ttl_s)
        return {"status": "ok", **part.handed_over()}

    async def confirm_loaded(self, transfer_id: str, rank: int) -> None:
        transfer = self._transfers.get(transfer_id)
        if transfer is None:
            return
        part = transfer.parts.get(rank)
        if part is not None:
            part.ref = None  # this rank's copy is in its KV cache; free the object now
        transfer.loaded_ranks.add(rank)
        if len(transfer.loaded_ranks) >= transfer.num_parts:
            self._close(transfer_id, "loaded")

    async def fail(self, transfer_id: str, reason: str) -> None:
        logger.warning("KV transfer %s failed: %s", transfer_id, reason)
        self._close(transfer_id, "failed")

    async def release(self, transfer_id: str) -> None:
        self._close(transfer_id, "released")

    async def ledger_snapshot(self) -> dict[str, Any]:
        """Transfers by how they ended, and what the object store holds now."""
        live_bytes = sum(transfer.live_bytes() for transfer in self._transfers.values())
        return self._ledger.snapshot(len(self._transfers), live_bytes)

    async def live_object_ids(self) -> list[str]:
        """Hex ids of the objects the directory still holds (for tests and debugging)."""
        return [
            part.ref.hex()
            for transfer in self._transfers.values()
            for part in transfer.parts.values()
            if part.ref is not None
        ]

    def _close(self, transfer_id: str, outcome: Outcome) -> None:
        if transfer_id in self._closed:
            return
        transfer = self._transfers.pop(transfer_id, None)
        self._closed[transfer_id] = outcome
        if len(self._closed) > CLOSED_MEMORY:
            self._closed.popitem(last=False)
        # Counted even when no part is registered yet: producers do not wait for their
        # registration, so a release can overtake it (the late part is then let go).
        self._ledger.count_outcome(outcome)
        self._announce_change()
        if transfer is not None:
            for key in transfer.pushed_to:
                inbox = self._inboxes.get(key)
                if inbox is not None:
                    inbox.changed.set()  # its consumer holds a copy it may drop now

    def _announce_change(self) -> None:
        self._registry_changed.set()
        self._registry_changed = asyncio.Event()

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            now = time.monotonic()
            expired = [tid for tid, transfer in self._transfers.items() if transfer.deadline < now]
            for transfer_id in expired:
                self._close(transfer_id, "expired")
            idle = [
                key
                for key, inbox in self._inboxes.items()
                if not inbox.polling and now - inbox.last_poll > INBOX_IDLE_S
            ]
            for key in idle:
                del self._inboxes[key]


KVObjectDirectory = ray.remote(TransferDirectory)


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)
