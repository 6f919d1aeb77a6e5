"""Each KV backend's settings, and the ``kv_transfer:`` block that names a backend.

In YAML the block is flat: ``backend`` plus that backend's own fields
(``kv_transfer: {backend: object_store, ttl_s: 30}``); it validates into
``KVTransferConfig`` whose ``settings`` are the backend's settings model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, SerializeAsAny, model_validator

from splitserve.config_base import StrictModel
from splitserve.registry import split_named_block

if TYPE_CHECKING:
    from vllm.config import VllmConfig

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
DEFAULT_NAMESPACE = "splitserve"
DEFAULT_STORAGE_PATH = "/tmp/splitserve-kv-example-disk"


class ObjectStoreSettings(StrictModel):
    """``kv_connector_extra_config`` of an ObjectStoreConnector; errors name the field."""

    # Ray namespace of the directory actor; prefill and decode engines must agree.
    namespace: str = Field(default=DEFAULT_NAMESPACE, min_length=1)
    # A transfer nobody loads within this time (client gone, decode failed) is freed.
    ttl_s: float = Field(default=60.0, gt=0)
    # How long a decode worker waits for a part that is not registered yet. A prefill
    # rank registers its part without waiting for the answer (the round trip stays off
    # the first token's path), so a claim can arrive first; a put that failed is never
    # registered, and this is how long the fallback to a local prefill waits.
    claim_wait_s: float = Field(default=1.0, ge=0)
    # How long a decode rank waits for a part pushed to it (the router named its engine)
    # before it claims the part instead. Pushes are sent when the part is registered,
    # before the first token reaches the client, so they normally arrive first.
    push_wait_s: float = Field(default=0.5, ge=0)

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig) -> ObjectStoreSettings:
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None
        return cls.model_validate(transfer_config.kv_connector_extra_config or {})


class ExampleDiskSettings(StrictModel):
    """vLLM's ExampleConnector, timed into our metrics (bench/kv_transfer.py's baseline)."""

    # The folder the prefill engine writes KV files to and the decode engine reads them
    # from (one machine); nothing ever deletes them.
    storage_path: str = Field(default=DEFAULT_STORAGE_PATH, min_length=1)


def _backends() -> Any:
    from kv_transfer.backend_registry import KV_BACKENDS

    return KV_BACKENDS


class KVTransferConfig(StrictModel):
    """PD only: which registered KV backend moves the prefill's KV, with its settings."""

    backend: str = Field(
        "object_store",
        description="A registered KV backend (kv_transfer.backend_registry.KV_BACKENDS):"
        " object_store (ours, through Ray's object store), example_disk (vLLM's"
        " ExampleConnector through files, a benchmark baseline, not for serving).",
    )
    settings: SerializeAsAny[StrictModel] = Field(default_factory=ObjectStoreSettings)

    @model_validator(mode="before")
    @classmethod
    def _settings_of_backend(cls, data: Any) -> Any:
        return split_named_block(data, "backend", "object_store", _backends(), "kv_transfer")

    def flat(self) -> dict[str, Any]:
        """As the YAML writes it: ``backend`` and its fields in one block."""
        return {"backend": self.backend, **self.settings.model_dump()}


class SimulatedKVSettings(StrictModel):
    """Simulated engines (engine.backend: simulated) hand over no KV: the decode engine
    waits the time its latency profile gives for the prompt's KV instead."""
