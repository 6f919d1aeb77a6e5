"""The connector's scheduler half, in the EngineCore process.

Prefill (producer): a request with ``do_remote_decode`` gets a SaveOrder in the step
that completes its prompt; the worker puts the blocks in the background, so the step's
output, the first token, does not wait for the copy. ``request_finished`` returns the
handle with that token and asks vLLM to keep the blocks (delayed free) until the worker
reports the put done; the next step's orders tell the worker the request has finished.

Decode (consumer): a request whose ``kv_transfer_params`` carry our handle reports the
transferred prompt tokens beyond its local prefix-cache hit as computed externally and
loaded asynchronously; a LoadOrder covers exactly those blocks, and says whether the
parts were pushed to this engine (the handle names it) or must be claimed. A handle is
loaded once: after a failed load vLLM recomputes locally and we never load again.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from kv_transfer.handle import (
    CONSUMER_KEY,
    KVLayoutMismatchError,
    LayoutFingerprint,
    TransferHandle,
    check_layout,
    is_transfer_params,
    prompt_digest,
)
from kv_transfer.object_store.directory import get_kv_directory
from kv_transfer.object_store.metadata import LoadOrder, SaveOrder, TransferOrders
from kv_transfer.settings import ObjectStoreSettings

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.splitserve.kv_transfer")

_HANDED_OFF = (RequestStatus.FINISHED_LENGTH_CAPPED,)


class _Match:
    """What get_num_new_matched_tokens decided, acted on once blocks are allocated."""

    def __init__(self, handle: TransferHandle, local_tokens: int, problem: str | None) -> None:
        self.handle = handle
        self.local_tokens = local_tokens
        self.problem = problem


class _Saved:
    """A prompt whose blocks a SaveOrder put; the handle is built when the request ends."""

    def __init__(
        self, transfer_id: str, num_tokens: int, digest: str, consumer: str | None
    ) -> None:
        self.transfer_id = transfer_id
        self.num_tokens = num_tokens
        self.digest = digest
        self.consumer = consumer


class TransferScheduler:
    def __init__(
        self,
        engine_id: str,
        layout: LayoutFingerprint,
        settings: ObjectStoreSettings,
        is_producer: bool,
        is_consumer: bool,
        directory: Any = None,
    ) -> None:
        """``directory``: the namespace's directory actor unless given (the fast tests
        give an in-process one)."""
        self._engine_id = engine_id
        self._layout = layout
        self._block_size = layout.block_size
        self._settings = settings
        self._is_producer = is_producer
        self._is_consumer = is_consumer
        self._kv_cache_manager: KVCacheManager | None = None
        # Joining Ray here makes a missing cluster fail engine start-up, not a request.
        self._directory = directory or get_kv_directory(settings.namespace)
        self._awaiting_prefill: dict[str, Request] = {}
        self._saved: dict[str, _Saved] = {}
        self._matches: dict[str, _Match] = {}
        self._orders = TransferOrders()

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager

    # ---- both roles -------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if self._is_producer and params and params.get("do_remote_decode"):
            self._awaiting_prefill[request.request_id] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TransferOrders:
        if self._awaiting_prefill:
            self._order_saves(scheduler_output.num_scheduled_tokens)
        orders, self._orders = self._orders, TransferOrders()
        return orders

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        self._awaiting_prefill.pop(request_id, None)
        self._matches.pop(request_id, None)
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and is_transfer_params(params):
            # Finished (aborted) before it was scheduled: nobody will load this transfer.
            params["do_remote_prefill"] = False
            with contextlib.suppress(ValueError):  # malformed: nothing we could release
                self._release(TransferHandle.from_params(params).transfer_id)
        saved = self._saved.pop(request_id, None)
        if saved is None:
            return False, None
        # The worker's put may still be reading the blocks, whatever became of the request.
        self._orders.finished_saves.append(request_id)
        if request.status not in _HANDED_OFF:
            # Aborted, or stopped at its first token (EOS): there is nothing to decode.
            self._release(saved.transfer_id)
            return True, None
        return True, self._handle(saved).to_params()

    # ---- producer -----------------------------------------------------------------

    def _order_saves(self, num_scheduled_tokens: dict[str, int]) -> None:
        for request_id, num_new_tokens in num_scheduled_tokens.items():
            request = self._awaiting_prefill.get(request_id)
            if request is None:
                continue
            if request.num_computed_tokens + num_new_tokens < request.num_prompt_tokens:
                continue  # a chunk of a longer prompt; save with the last chunk
            del self._awaiting_prefill[request_id]
            self._orders.saves.append(self._save_order(request))

    def _save_order(self, request: Request) -> SaveOrder:
        assert self._kv_cache_manager is not None
        num_tokens = request.num_prompt_tokens
        num_blocks = -(-num_tokens // self._block_size)
        (block_ids,) = self._kv_cache_manager.get_block_ids(request.request_id)
        transfer_id = f"{self._engine_id[:8]}-{uuid.uuid4().hex}"
        digest = prompt_digest((request.prompt_token_ids or [])[:num_tokens])
        consumer = (request.kv_transfer_params or {}).get(CONSUMER_KEY)
        consumer = consumer if isinstance(consumer, str) and consumer else None
        self._saved[request.request_id] = _Saved(transfer_id, num_tokens, digest, consumer)
        return SaveOrder(
            request_id=request.request_id,
            transfer_id=transfer_id,
            block_ids=list(block_ids[:num_blocks]),
            num_parts=self._layout.tp_size,
            ttl_s=self._settings.ttl_s,
            consumer=consumer,
        )

    def _handle(self, saved: _Saved) -> TransferHandle:
        return TransferHandle(
            transfer_id=saved.transfer_id,
            producer=self._engine_id,
            namespace=self._settings.namespace,
            num_tokens=saved.num_tokens,
            prompt_digest=saved.digest,
            num_parts=self._layout.tp_size,
            layout=self._layout,
            expires_at=time.time() + self._settings.ttl_s,
            consumer=saved.consumer,
        )

    # ---- consumer -----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not (self._is_consumer and params and params.get("do_remote_prefill")):
            return 0, False
        if not is_transfer_params(params):
            return 0, False  # another connector's handle
        try:
            handle = TransferHandle.from_params(params)
        except ValueError as error:
            logger.error("request %s: %s; computing it locally", request.request_id, error)
            params["do_remote_prefill"] = False
            return 0, False
        problem = self._problem_with(handle, request)
        self._matches[request.request_id] = _Match(handle, num_computed_tokens, problem)
        if problem is not None:
            return 0, False
        # Everything the prefill engine computed beyond our own prefix-cache hit.
        count = handle.num_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        match = self._matches.pop(request.request_id, None)
        if match is None:
            return
        assert request.kv_transfer_params is not None
        request.kv_transfer_params["do_remote_prefill"] = False  # claimed: one load, ever
        transfer_id = match.handle.transfer_id
        if match.problem is not None:
            logger.error("request %s: %s; computing it locally", request.request_id, match.problem)
            self._directory.fail.remote(transfer_id, match.problem)
            return
        if num_external_tokens == 0:
            self._release(transfer_id)  # the local prefix cache had every block
            return
        first_token = match.handle.num_tokens - num_external_tokens
        (block_ids,) = blocks.get_block_ids()
        first_block = first_token // self._block_size
        last_block = -(-match.handle.num_tokens // self._block_size)
        self._orders.loads.append(
            LoadOrder(
                request_id=request.request_id,
                transfer_id=transfer_id,
                first_source_block=first_block,
                block_ids=list(block_ids[first_block:last_block]),
                pushed=match.handle.consumer == self._engine_id,
                # vLLM offers block-aligned local hits; a load starting inside a block
                # could overwrite a shared cached block, so it is refused.
                problem=f"load starts inside a block, at token {first_token}"
                if first_token % self._block_size
                else None,
            )
        )

    def _problem_with(self, handle: TransferHandle, request: Request) -> str | None:
        """Why this handle must not be loaded into this request, or None."""
        try:
            check_layout(handle, self._layout)
        except KVLayoutMismatchError as error:
            return str(error)
        if handle.namespace != self._settings.namespace:
            return f"handle is for Ray namespace {handle.namespace!r}, not ours"
        prompt = request.prompt_token_ids or []
        if handle.num_tokens > len(prompt):
            return f"handle covers {handle.num_tokens} tokens, the prompt has {len(prompt)}"
        if prompt_digest(prompt[: handle.num_tokens]) != handle.prompt_digest:
            return "the prompt is not the one the transferred KV was computed for"
        return None

    def _release(self, transfer_id: str) -> None:
        self._directory.release.remote(transfer_id)
