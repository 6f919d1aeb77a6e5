"""A vLLM KV connector that moves a request's KV blocks through Ray's object store.

Engine side: ``kv_transfer_config(role)`` is the engine argument that loads
``ObjectStoreConnector``; ``consumer_id`` is how a decode engine is named. Router side:
``remote_decode_params(consumer)`` marks a prefill request and names the decode engine
its KV goes to, ``release_handle`` frees a handle that will never be decoded,
``get_kv_directory().metrics_snapshot.remote()`` returns the transfer metrics and
``KVTransferCollector`` exports them; ``check_handle_compatible`` lets a
decode host refuse a handle from an engine with another KV layout before submitting.
The connector class is imported lazily, so the router does not import torch for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kv_transfer.directory import get_kv_directory, release_handle, shutdown_kv_directory
from kv_transfer.handle import (
    KVLayoutMismatchError,
    LayoutFingerprint,
    check_handle_compatible,
    consumer_id,
    layout_fingerprint,
    remote_decode_params,
)
from kv_transfer.metrics import KVTransferCollector
from kv_transfer.settings import ConnectorSettings, kv_transfer_config

if TYPE_CHECKING:
    from kv_transfer.connector import ObjectStoreConnector

__all__ = [
    "ConnectorSettings",
    "KVLayoutMismatchError",
    "KVTransferCollector",
    "LayoutFingerprint",
    "ObjectStoreConnector",
    "check_handle_compatible",
    "consumer_id",
    "get_kv_directory",
    "kv_transfer_config",
    "layout_fingerprint",
    "release_handle",
    "remote_decode_params",
    "shutdown_kv_directory",
]


def __getattr__(name: str) -> Any:
    if name == "ObjectStoreConnector":
        from kv_transfer.connector import ObjectStoreConnector

        return ObjectStoreConnector
    raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
