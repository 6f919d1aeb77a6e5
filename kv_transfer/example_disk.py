"""vLLM's ExampleConnector (KV through files), timed into our transfer metrics.

The baseline that bench/kv_transfer.py compares ObjectStoreConnector with; select it
with ``kv_transfer: {backend: example_disk, storage_path: ...}``. vLLM's connector
runs unchanged: the prefill engine writes one safetensors file per layer during its
forward pass, the decode engine finds the folder by the prompt's hash and reads the
files into its pages before its own forward pass. This subclass only times the two and
counts them as ``put`` and ``get`` in the object-store connector's statistics, which
vLLM carries to the engine's host the same way (object_store/stats.py), so that
``splitserve_kv_transfer_seconds`` measures both connectors alike.

One observation per engine step and operation (every request saved or loaded in that
step together): exact per request for a sequential workload, which is how the bench
runs it. Not for serving: nothing deletes the files, the load blocks the engine step,
and no handle is returned (the decode engine trusts whatever the folder holds).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)

from kv_transfer.metrics import Operation
from kv_transfer.object_store.stats import (
    CountsTransferStats,
    TransferStats,
    TransferStatsRecorder,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig


class TimedExampleConnector(CountsTransferStats, ExampleConnector):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # One hand-over per step and operation, counted by the first rank; every rank
        # counts the bytes of its own shard.
        rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        self._stats = TransferStatsRecorder(rank)
        self._bytes_per_token = _bytes_per_token(kv_cache_config)
        self._save_seconds = 0.0  # this step's save_kv_layer calls, every layer

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        started = time.perf_counter()
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        self._save_seconds += time.perf_counter() - started

    def wait_for_save(self) -> None:
        super().wait_for_save()
        self._report("put", self._save_seconds, self._step_tokens(is_store=True))
        self._save_seconds = 0.0

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        started = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)
        seconds = time.perf_counter() - started
        self._report("get", seconds, self._step_tokens(is_store=False))

    def get_kv_connector_stats(self) -> TransferStats | None:
        return self._stats.take()

    def _step_tokens(self, is_store: bool) -> int:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ExampleConnectorMetadata)
        return sum(len(r.slot_mapping) for r in metadata.requests if r.is_store == is_store)

    def _report(self, op: Operation, seconds: float, num_tokens: int) -> None:
        if num_tokens:
            self._stats.observe(op, seconds, num_tokens * self._bytes_per_token)


def _bytes_per_token(kv_cache_config: KVCacheConfig) -> int:
    """KV bytes of one token in this worker, every layer (K and V)."""
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    return spec.page_size_bytes // spec.block_size * len(group.layer_names)
