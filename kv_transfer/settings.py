"""The connector's settings and the vLLM ``kv_transfer_config`` that selects it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from vllm.config import VllmConfig

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
# object_store: ours. example_disk: vLLM's ExampleConnector (KV through files), the
# baseline bench/kv_transfer.py compares ours with; not for serving.
ConnectorName = Literal["object_store", "example_disk"]
CONNECTOR_CLASS = "ObjectStoreConnector"
CONNECTOR_MODULE = "kv_transfer.connector"
EXAMPLE_DISK_CLASS = "TimedExampleConnector"
EXAMPLE_DISK_MODULE = "kv_transfer.example_disk"
DEFAULT_NAMESPACE = "splitserve"
DEFAULT_STORAGE_PATH = "/tmp/splitserve-kv-example-disk"


class ConnectorSettings(BaseModel):
    """``kv_connector_extra_config`` of an ObjectStoreConnector; errors name the field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

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
    # Which connector the PD engines load. The fields above are the object store's;
    # example_disk uses only storage_path (and namespace, for its metrics).
    connector: ConnectorName = "object_store"
    # example_disk: the folder the prefill engine writes KV files to and the decode
    # engine reads them from (one machine); nothing ever deletes them.
    storage_path: str = Field(default=DEFAULT_STORAGE_PATH, min_length=1)

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig) -> ConnectorSettings:
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None
        return cls.model_validate(transfer_config.kv_connector_extra_config or {})


def kv_transfer_config(
    role: KVRole, *, engine_id: str | None = None, **extra: Any
) -> dict[str, Any]:
    """The ``kv_transfer_config`` engine argument that loads our connector.

    ``extra`` are ConnectorSettings fields (``ttl_s``, ``namespace``, ``claim_wait_s``,
    ``push_wait_s``, ``connector``, ``storage_path``). Load failures are recomputed,
    never fatal: a lost or expired transfer costs the decode engine a local prefill,
    not the request.
    """
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ValueError(f"role must be kv_producer, kv_consumer or kv_both, not {role!r}")
    settings = ConnectorSettings(**extra)
    example_disk = settings.connector == "example_disk"
    config: dict[str, Any] = {
        "kv_connector": EXAMPLE_DISK_CLASS if example_disk else CONNECTOR_CLASS,
        "kv_connector_module_path": EXAMPLE_DISK_MODULE if example_disk else CONNECTOR_MODULE,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        # ExampleConnector reads its folder from "shared_storage_path".
        "kv_connector_extra_config": settings.model_dump()
        | ({"shared_storage_path": settings.storage_path} if example_disk else {}),
    }
    if engine_id is not None:
        config["engine_id"] = engine_id
    return config
