"""In-process stand-ins for what the KV connector reaches through Ray: the object store
(a dict) and the directory actor (the real ``TransferDirectory`` on an event loop of
its own), so the scheduler and worker halves run in the fast tests without a cluster.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kv_transfer.object_store.directory import TransferDirectory


@dataclass(frozen=True)
class MemoryRef:
    key: int


class MemoryObjectStore:
    """``put`` keeps a copy, as Ray's store does; ``get`` also answers actor calls."""

    def __init__(self) -> None:
        self.objects: dict[MemoryRef, Any] = {}
        self._keys = itertools.count()

    def put(self, value: Any) -> MemoryRef:
        ref = MemoryRef(next(self._keys))
        self.objects[ref] = copy.deepcopy(value)
        return ref

    def get(self, ref: Any, timeout_s: float | None = None) -> Any:
        if isinstance(ref, concurrent.futures.Future):
            return ref.result(timeout_s)
        return self.objects[ref]


class _RemoteMethod:
    def __init__(self, actor: LocalActor, name: str) -> None:
        self._actor = actor
        self._name = name

    def remote(self, *args: Any) -> concurrent.futures.Future[Any]:
        method = getattr(self._actor.instance, self._name)
        return asyncio.run_coroutine_threadsafe(method(*args), self._actor.loop)


class LocalActor:
    """``actor.method.remote(...)`` runs the coroutine on the actor's own loop thread and
    returns a future, as a Ray actor call returns an ObjectRef."""

    def __init__(self, loop: asyncio.AbstractEventLoop, instance: Any) -> None:
        self.loop = loop
        self.instance = instance

    def __getattr__(self, name: str) -> _RemoteMethod:
        return _RemoteMethod(self, name)

    def call(self, name: str, *args: Any) -> Any:
        """Call and wait, as a test does."""
        return getattr(self, name).remote(*args).result(10)


def _make_directory() -> TransferDirectory:
    return TransferDirectory()


@dataclass
class DirectoryLoop:
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    def directory(self) -> LocalActor:
        async def build() -> TransferDirectory:
            return _make_directory()

        instance = asyncio.run_coroutine_threadsafe(build(), self.loop).result(10)
        return LocalActor(self.loop, instance)


def directory_loop() -> Iterator[DirectoryLoop]:
    """An event loop on a thread of its own, for the length of a fixture."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="directory", daemon=True)
    thread.start()
    try:
        yield DirectoryLoop(loop, thread)
    finally:
        asyncio.run_coroutine_threadsafe(_cancel_others(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


async def _cancel_others() -> None:
    """The directory's sweeper runs forever: end it before its loop closes."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
