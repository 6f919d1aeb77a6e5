"""The connector's worker half, in each vLLM worker rank (one process per TP rank).

Save (prefill): in ``wait_for_save``, after the forward pass that wrote the prompt's KV,
each rank hands the request's blocks to its saver thread, which puts its own shard (one
object holding every layer), registers it with the directory (naming the decode engine,
if the router chose one) without waiting for the answer, and counts it in its transfer
statistics (stats.py). The step, and with it the first token, pays for neither. vLLM
keeps the blocks until the put is reported done (``finished_sending``), which happens
once the scheduler has finished the request too; and before any forward pass, a put
whose request the scheduler has not finished is waited for, since only a finished
request's blocks are sure to stay put (a running one could be preempted and its blocks
handed to another request).

Load (decode): ``start_load_kv`` hands each LoadOrder to a thread that takes the part
pushed to this rank (``PushedParts``; already fetched) or else claims it from the
directory and gets it (zero copy from the local object store), checks its page layout
against ours, writes the pages, confirms and counts it; the scheduler hears about it
through ``transfer_results`` on a later step. A failed load reports its blocks as load
errors, and vLLM recomputes them (``kv_load_failure_policy="recompute"``).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kv_transfer.metrics import LoadPath
from kv_transfer.object_store.directory import get_kv_directory
from kv_transfer.object_store.metadata import LoadOrder, SaveOrder
from kv_transfer.object_store.paged_cache import PagedKVCache
from kv_transfer.object_store.pushed_parts import FetchedPart, PushedParts
from kv_transfer.object_store.stats import TransferStats, TransferStatsRecorder
from kv_transfer.object_store.store import ObjectStore, RayObjectStore
from kv_transfer.settings import ObjectStoreSettings

logger = logging.getLogger("vllm.splitserve.kv_transfer")

# Two loads in flight overlap one's directory round trip with the other's copy.
LOADER_THREADS = 2


class TransferLostError(RuntimeError):
    """The directory has no usable part for this transfer (expired, released, failed)."""


@dataclass(frozen=True, slots=True)
class _LoadResult:
    request_id: str
    failed_block_ids: tuple[int, ...]


class TransferWorker:
    def __init__(
        self,
        rank: int,
        block_size: int,
        settings: ObjectStoreSettings,
        consumer: str | None,
        store: ObjectStore | None = None,
        directory: Any = None,
    ) -> None:
        """``consumer``: this engine's ``consumer_id`` if it loads KV, else None.
        ``store``, ``directory``: Ray's object store and the namespace's directory actor
        unless given (the fast tests give in-process ones)."""
        self._rank = rank
        self._block_size = block_size
        self._settings = settings
        self._consumer = consumer
        self._store: ObjectStore = store or RayObjectStore()
        self._cache: PagedKVCache | None = None
        self._directory: Any = directory
        self._pushed: PushedParts | None = None
        self._loader = ThreadPoolExecutor(LOADER_THREADS, thread_name_prefix="kv-load")
        # One thread: puts run in the order their steps ordered them.
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kv-save")
        self._saves: dict[str, Future[None]] = {}  # request id -> its put, until reported
        self._finished_saves: set[str] = set()  # of those, requests vLLM has finished
        self._finished_loads: queue.SimpleQueue[_LoadResult] = queue.SimpleQueue()
        self._load_errors: set[int] = set()
        self._stats = TransferStatsRecorder(rank)

    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], backend: str = "unknown"
    ) -> None:
        """``backend``: the attention backend and KV layout, named in errors."""
        self._cache = PagedKVCache(kv_caches, self._block_size, backend)
        # Join Ray now, at engine start-up, rather than inside the first request.
        if self._directory is None:
            self._directory = get_kv_directory(self._settings.namespace)
        if self._consumer is not None:
            self._pushed = PushedParts(
                self._directory, self._consumer, self._rank, self._settings.ttl_s, self._store
            )
            self._pushed.start()

    # ---- prefill ------------------------------------------------------------------

    def save(self, orders: Iterable[SaveOrder]) -> None:
        assert self._cache is not None
        # Marks this step's KV writes (a CUDA event on a GPU): the put reads after them.
        written = self._cache.writes_done()
        for order in orders:
            self._saves[order.request_id] = self._saver.submit(self._save_logged, order, written)

    def settle_saves(self, finished_request_ids: Iterable[str]) -> None:
        """Before a forward pass: wait for puts whose blocks vLLM could hand out."""
        self._finished_saves.update(finished_request_ids)
        for request_id, put in self._saves.items():
            if request_id not in self._finished_saves:
                put.result()

    def _save_logged(self, order: SaveOrder, written: Any) -> None:
        try:
            self._save(order, written)
        except Exception:
            # The decode side will find no part, report the load failed and recompute.
            logger.exception("KV transfer %s: put failed", order.transfer_id)

    def _saves_done(self) -> set[str]:
        """Finished requests whose put is over: vLLM may free their blocks now."""
        done = {rid for rid in self._finished_saves if self._put_over(rid)}
        for request_id in done:
            self._saves.pop(request_id, None)
        self._finished_saves -= done
        return done

    def _put_over(self, request_id: str) -> bool:
        put = self._saves.get(request_id)
        return put is None or put.done()  # None: no put here ever read its blocks

    def _save(self, order: SaveOrder, written: Any = None) -> None:
        assert self._cache is not None
        started = time.perf_counter()
        # CPU: the only copy (views of the pages); GPU: gathered on a side stream into
        # pinned memory first. vLLM keeps the pages until we report this put done.
        ref = self._store.put(self._cache.pack(order.block_ids, after=written))
        seconds = time.perf_counter() - started
        nbytes = len(order.block_ids) * self._cache.page_bytes * self._cache.num_layers
        # Not awaited: a claim that comes first waits for it (claim_wait_s). Ray keeps
        # the object alive for the pending call, then the directory's borrowed
        # reference alone does.
        self._directory.register.remote(
            order.transfer_id,
            self._rank,
            order.num_parts,
            [ref],
            nbytes,
            self._cache.layout,
            order.ttl_s,
            order.consumer,
        )
        self._stats.observe("put", seconds, nbytes)

    # ---- decode -------------------------------------------------------------------

    def start_loads(self, orders: Iterable[LoadOrder]) -> None:
        for order in orders:
            arrived = self._take_pushed(order, wait_s=0.0)
            if arrived is not None:
                # Already fetched: writing its pages costs less than an engine step, and
                # done now it is reported with this step, so the request is scheduled a
                # step sooner than after a load on the loader thread.
                self._load_and_report(order, arrived)
            else:
                self._loader.submit(self._load_and_report, order, None)

    def transfer_results(self) -> KVConnectorTransferResults:
        """Puts and loads finished since the last call; failed loads' blocks go to
        ``take_load_errors``."""
        finished: set[str] = set()
        while True:
            try:
                result = self._finished_loads.get_nowait()
            except queue.Empty:
                break
            finished.add(result.request_id)
            self._load_errors.update(result.failed_block_ids)
        return KVConnectorTransferResults(
            finished_sending=self._saves_done(), finished_recving=finished
        )

    def take_stats(self) -> TransferStats | None:
        """Puts and loads counted since the last call (vLLM's ``get_kv_connector_stats``)."""
        return self._stats.take()

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._pushed is not None:
            self._pushed.stop()
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._saver.shutdown(wait=False, cancel_futures=True)

    def _load_and_report(self, order: LoadOrder, arrived: FetchedPart | None) -> None:
        failed: tuple[int, ...] = ()
        try:
            self._load(order, arrived)
        except Exception as error:
            reason = f"{type(error).__name__}: {error}"
            logger.warning("KV transfer %s not loaded (%s); recomputing", order.transfer_id, reason)
            self._directory.fail.remote(order.transfer_id, reason)
            failed = tuple(order.block_ids)
        self._finished_loads.put(_LoadResult(order.request_id, failed))

    def _load(self, order: LoadOrder, arrived: FetchedPart | None) -> None:
        """Write the part's pages: ``arrived`` if given, else pushed or claimed now."""
        assert self._cache is not None
        if order.problem is not None:
            raise ValueError(order.problem)
        part = arrived or self._take_pushed(order, self._settings.push_wait_s)
        path: LoadPath = "pushed"
        if part is None:
            part, path = self._claim(order), "claimed"
        if part.layout != self._cache.layout:
            raise ValueError(f"part layout {part.layout} != ours {self._cache.layout}")
        started = time.perf_counter()
        nbytes = self._cache.unpack(part.packed, order.first_source_block, order.block_ids)
        seconds = part.get_seconds + time.perf_counter() - started
        # Drop our views of the object now; a caller that passed it in drops its own
        # when it returns (our ref keeps the object alive until then either way).
        del part
        self._directory.confirm_loaded.remote(order.transfer_id, self._rank)
        self._stats.observe("get", seconds, nbytes)
        self._stats.count_load(path)

    def _take_pushed(self, order: LoadOrder, wait_s: float) -> FetchedPart | None:
        if not order.pushed or self._pushed is None or order.problem is not None:
            return None
        return self._pushed.take(order.transfer_id, wait_s)

    def _claim(self, order: LoadOrder) -> FetchedPart:
        started = time.perf_counter()
        claim = self._store.get(
            self._directory.claim.remote(order.transfer_id, self._rank, self._settings.claim_wait_s)
        )
        if claim["status"] != "ok":
            raise TransferLostError(f"transfer is {claim['status']}")
        (ref,) = claim["refs"]
        packed = self._store.get(ref, self._settings.ttl_s)
        return FetchedPart(ref, packed, claim["layout"], time.perf_counter() - started)
