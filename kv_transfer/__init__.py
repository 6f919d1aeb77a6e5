"""A vLLM KV connector that moves a request's KV blocks through Ray's object store.

Backends by name (``KV_BACKENDS``, kv_transfer/backend_registry.py): ``object_store`` (ours) and
``example_disk`` (vLLM's ExampleConnector, a benchmark baseline). A backend gives each
engine its vLLM ``kv_transfer_config`` and the router its side of the hand-over
(``KVRouterSide``: the prefill request's params, releasing a transfer nobody will
load, the ledger ``KVTransferCollector`` exports beside the engines' transfer
statistics) and each engine's host its
side (``KVEngineSide``: how a decode engine is named, which handles it refuses).
The connector class is imported lazily, so the router does not import torch for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kv_transfer.backend_registry import (
    KV_BACKENDS,
    KVBackend,
    KVEngineSide,
    KVRouterSide,
    make_kv_backend,
)
from kv_transfer.handle import (
    KVLayoutMismatchError,
    LayoutFingerprint,
    check_handle_compatible,
    consumer_id,
    layout_fingerprint,
    remote_decode_params,
)
from kv_transfer.metrics import KVTransferCollector
from kv_transfer.object_store.directory import (
    get_kv_directory,
    release_handle,
    shutdown_kv_directory,
)
from kv_transfer.settings import KVTransferConfig, ObjectStoreSettings

if TYPE_CHECKING:
    from kv_transfer.object_store.connector import ObjectStoreConnector

__all__ = [
    "KV_BACKENDS",
    "KVBackend",
    "KVEngineSide",
    "KVLayoutMismatchError",
    "KVRouterSide",
    "KVTransferCollector",
    "KVTransferConfig",
    "LayoutFingerprint",
    "ObjectStoreConnector",
    "ObjectStoreSettings",
    "check_handle_compatible",
    "consumer_id",
    "get_kv_directory",
    "layout_fingerprint",
    "make_kv_backend",
    "release_handle",
    "remote_decode_params",
    "shutdown_kv_directory",
]


def __getattr__(name: str) -> Any:
    if name == "ObjectStoreConnector":
        from kv_transfer.object_store.connector import ObjectStoreConnector

        return ObjectStoreConnector
    raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
