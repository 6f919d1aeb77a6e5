"""ObjectStoreConnector: vLLM's KV connector interface over Ray's object store.

The package follows vLLM's connector layout: this front, the scheduler half
(scheduler.py), the worker half (worker.py), the orders the first sends the second each
step (metadata.py), the statistics vLLM carries to the stat loggers (stats.py), and
what only this backend has: the directory actor (directory.py), the store seam
(store.py), the paged-cache packing (paged_cache.py) and the push path
(pushed_parts.py).

vLLM builds one instance in the EngineCore (role SCHEDULER) and one in every worker
rank (role WORKER); this class only routes each call to the half that owns it
(``scheduler.TransferScheduler``, ``worker.TransferWorker``). Select it with
``ObjectStoreBackend.engine_config(role)`` (kv_transfer/builtin_backends.py).

Granularity: one object per request per rank holding every layer, packed as views
of the cache pages, so that ``ray.put`` makes the only copy on the prefill side and the
write into the pages the only one on the decode side. In the steady state (the store's
pages touched once) it put 64 MiB in about 5 ms against 11 ms for one object per layer
(16 create/seal round trips); a staging buffer pays a fresh buffer's page faults each
time. The figures and how they were measured: docs/DECISIONS.md, "KV object
granularity"; bench/kv_transfer.py part (a) reproduces them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kv_transfer.handle import consumer_id, layout_fingerprint
from kv_transfer.object_store.directory import disconnect_ray
from kv_transfer.object_store.metadata import TransferOrders
from kv_transfer.object_store.scheduler import TransferScheduler
from kv_transfer.object_store.stats import CountsTransferStats, TransferStats
from kv_transfer.object_store.worker import TransferWorker
from kv_transfer.settings import ObjectStoreSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class ObjectStoreConnector(CountsTransferStats, KVConnectorBase_V1):
    """Moves one request's KV blocks from a prefill engine to a decode engine via Ray."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _check_supported(vllm_config, kv_cache_config)
        settings = ObjectStoreSettings.from_vllm_config(vllm_config)
        self._scheduler: TransferScheduler | None = None
        self._worker: TransferWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            transfer_config = self._kv_transfer_config
            self._scheduler = TransferScheduler(
                engine_id=str(transfer_config.engine_id),
                layout=layout_fingerprint(vllm_config),
                settings=settings,
                is_producer=transfer_config.is_kv_producer,
                is_consumer=transfer_config.is_kv_consumer,
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = TransferWorker(
                rank=get_tensor_model_parallel_rank(),
                block_size=vllm_config.cache_config.block_size,
                settings=settings,
                consumer=consumer_id(vllm_config),
            )

    # ---- scheduler side -------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler_half.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        self._scheduler_half.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler_half.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler_half.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_half.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_half.request_finished(request)

    # ---- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_half.register_kv_caches(kv_caches, attention_backend_name(self._vllm_config))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # vLLM binds each step's orders before its forward pass (start_load_kv, for
        # asynchronous loads, comes after it): the last moment to protect the pages.
        self._worker_half.settle_saves(self._orders().finished_saves)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker_half.start_loads(self._orders().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete between steps, before the request is scheduled

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # one put per request after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        self._worker_half.save(self._orders().saves)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker_half.transfer_results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_half.take_load_errors()

    # ---- statistics (either side: vLLM asks the scheduler's too, which has none) ------

    def get_kv_connector_stats(self) -> TransferStats | None:
        return None if self._worker is None else self._worker.take_stats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        disconnect_ray()

    # ---- helpers --------------------------------------------------------------------

    @property
    def _scheduler_half(self) -> TransferScheduler:
        assert self._scheduler is not None, "scheduler-side call on a worker-side connector"
        return self._scheduler

    @property
    def _worker_half(self) -> TransferWorker:
        assert self._worker is not None, "worker-side call on a scheduler-side connector"
        return self._worker

    def _orders(self) -> TransferOrders:
        orders = self._get_connector_metadata()
        assert isinstance(orders, TransferOrders)
        return orders


def _check_supported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise NotImplementedError("ObjectStoreConnector supports TP, not pipeline parallelism")
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        raise NotImplementedError("ObjectStoreConnector does not support context parallelism")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        raise NotImplementedError(
            "ObjectStoreConnector supports models with one full-attention KV cache group, "
            f"this one has {[type(group.kv_cache_spec).__name__ for group in groups]}"
        )
    if isinstance(groups[0].kv_cache_spec, MLAAttentionSpec):
        raise NotImplementedError(
            f"ObjectStoreConnector does not move MLA KV caches (attention backend"
            f" {attention_backend_name(vllm_config)}); MLA models need a connector that"
            " knows its latent layout"
        )


def attention_backend_name(vllm_config: VllmConfig) -> str:
    """The attention backend and KV layout, as errors name them."""
    backend = getattr(vllm_config.attention_config, "backend", None)
    layout = vllm_config.cache_config.kv_cache_layout
    name = getattr(backend, "name", None) or "auto"
    return f"{name}, layout {layout}" if layout else name
