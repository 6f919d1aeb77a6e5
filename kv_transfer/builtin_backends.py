"""The built-in KV backends (see kv_transfer/backend_registry.py).

``object_store``: ours, ``ObjectStoreConnector``: the prefill's blocks go into Ray's
object store, pushed to the decode engine the router named, freed once loaded, on
release or after a TTL. ``example_disk``: vLLM's ExampleConnector through files,
timed into our metrics; the baseline bench/kv_transfer.py measures ours against, not
for serving (nothing deletes its files).
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

from kv_transfer.backend_registry import KV_BACKENDS
from kv_transfer.handle import (
    check_handle_compatible,
    consumer_id,
    is_transfer_params,
    remote_decode_params,
    remote_prefill_params,
)
from kv_transfer.object_store.directory import (
    get_kv_directory,
    release_handle,
    shutdown_kv_directory,
)
from kv_transfer.settings import ExampleDiskSettings, KVRole, ObjectStoreSettings
from splitserve.config_base import StrictModel

_ROLES = ("kv_producer", "kv_consumer", "kv_both")


def _vllm_transfer_config(
    connector: str, module: str, role: KVRole, extra: dict[str, Any], engine_id: str | None
) -> dict[str, Any]:
    if role not in _ROLES:
        raise ValueError(f"role must be kv_producer, kv_consumer or kv_both, not {role!r}")
    config: dict[str, Any] = {
        "kv_connector": connector,
        "kv_connector_module_path": module,
        "kv_role": role,
        # A lost or expired transfer costs the decode engine a local prefill, never the
        # request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    if engine_id is not None:
        config["engine_id"] = engine_id
    return config


class PlainRouterSide:
    """The router's side of a backend that keeps no ledger: the handle passes from the
    prefill answer to the decode request, and nothing is held to release."""

    def prefill_params(self, consumer: str | None) -> dict[str, Any]:
        return remote_decode_params(consumer)

    def decode_params(self, handle: dict[str, Any] | None) -> dict[str, Any]:
        return remote_prefill_params(handle)

    def release(self, handle: dict[str, Any]) -> None:
        return None

    async def ledger_snapshot(self) -> dict[str, Any] | None:
        return None

    def shutdown(self) -> None:
        return None


class DirectoryRouterSide(PlainRouterSide):
    """The router's side of the object store: the KV directory actor holds each
    transfer until it is loaded, released or expired, and keeps the ledger."""

    def __init__(self, namespace: str) -> None:
        self._namespace = namespace

    def release(self, handle: dict[str, Any]) -> None:
        release_handle(handle)

    async def ledger_snapshot(self) -> dict[str, Any] | None:
        return await get_kv_directory(self._namespace).ledger_snapshot.remote()

    def shutdown(self) -> None:
        # The directory is a detached actor: it goes with the application.
        with contextlib.suppress(Exception):
            shutdown_kv_directory(self._namespace)


class HandleCheckingEngineSide:
    """Engines of the object-store connector: named by their KV engine id, and a handle
    from an engine with another KV layout is refused before it reaches vLLM."""

    def consumer_name(self, vllm_config: Any) -> str | None:
        return consumer_id(vllm_config)

    def check_request(self, kv_transfer_params: dict[str, Any], vllm_config: Any) -> None:
        if is_transfer_params(kv_transfer_params):
            check_handle_compatible(kv_transfer_params, vllm_config)


class PassiveEngineSide:
    """Engines of a connector that finds its KV itself (by prompt): nothing to name or check."""

    def consumer_name(self, vllm_config: Any) -> str | None:
        return None

    def check_request(self, kv_transfer_params: dict[str, Any], vllm_config: Any) -> None:
        return None


@KV_BACKENDS.register("object_store")
class ObjectStoreBackend:
    settings_model: ClassVar[type[StrictModel]] = ObjectStoreSettings

    def __init__(self, settings: StrictModel) -> None:
        assert isinstance(settings, ObjectStoreSettings)
        self.settings = settings

    def engine_config(self, role: KVRole, engine_id: str | None = None) -> dict[str, Any]:
        extra = self.settings.model_dump()
        return _vllm_transfer_config(
            "ObjectStoreConnector", "kv_transfer.object_store.connector", role, extra, engine_id
        )

    def router_side(self) -> DirectoryRouterSide:
        return DirectoryRouterSide(self.settings.namespace)

    def engine_side(self) -> HandleCheckingEngineSide:
        return HandleCheckingEngineSide()

    def check_parallelism(self, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        if pipeline_parallel_size > 1:
            raise ValueError(
                "kv_transfer backend 'object_store' does not support pipeline parallelism"
            )


@KV_BACKENDS.register("example_disk")
class ExampleDiskBackend:
    settings_model: ClassVar[type[StrictModel]] = ExampleDiskSettings

    def __init__(self, settings: StrictModel) -> None:
        assert isinstance(settings, ExampleDiskSettings)
        self.settings = settings

    def engine_config(self, role: KVRole, engine_id: str | None = None) -> dict[str, Any]:
        # ExampleConnector reads its folder from "shared_storage_path".
        extra = {**self.settings.model_dump(), "shared_storage_path": self.settings.storage_path}
        return _vllm_transfer_config(
            "TimedExampleConnector", "kv_transfer.example_disk", role, extra, engine_id
        )

    def router_side(self) -> PlainRouterSide:
        # Its files are never handed over, so there is nothing to release.
        return PlainRouterSide()

    def engine_side(self) -> PassiveEngineSide:
        return PassiveEngineSide()

    def check_parallelism(self, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        return None  # vLLM's connector handles what vLLM runs
