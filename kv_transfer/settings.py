"""The connector's settings and the vLLM ``kv_transfer_config`` that selects it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from vllm.config import VllmConfig

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
CONNECTOR_CLASS = "ObjectStoreConnector"
CONNECTOR_MODULE = "kv_transfer.connector"
DEFAULT_NAMESPACE = "splitserve"


class ConnectorSettings(BaseModel):
    """``kv_connector_extra_config`` of an ObjectStoreConnector; errors name the field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Ray namespace of the directory actor; prefill and decode engines must agree.
    namespace: str = Field(default=DEFAULT_NAMESPACE, min_length=1)
    # A transfer nobody loads within this time (client gone, decode failed) is freed.
    ttl_s: float = Field(default=60.0, gt=0)
    # How long a decode worker waits for a part that is not registered. Parts are
    # registered before the handle exists, so this only delays the fallback to a local
    # prefill when a put failed.
    claim_wait_s: float = Field(default=1.0, ge=0)

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig) -> ConnectorSettings:
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None
        return cls.model_validate(transfer_config.kv_connector_extra_config or {})


def kv_transfer_config(
    role: KVRole, *, engine_id: str | None = None, **extra: Any
) -> dict[str, Any]:
    """The ``kv_transfer_config`` engine argument that loads our connector.

    ``extra`` are ConnectorSettings fields (``ttl_s``, ``namespace``, ``claim_wait_s``).
    Load failures are recomputed, never fatal: a lost or expired transfer costs the
    decode engine a local prefill, not the request.
    """
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ValueError(f"role must be kv_producer, kv_consumer or kv_both, not {role!r}")
    config: dict[str, Any] = {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": ConnectorSettings(**extra).model_dump(),
    }
    if engine_id is not None:
        config["engine_id"] = engine_id
    return config
