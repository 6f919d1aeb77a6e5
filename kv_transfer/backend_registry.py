"""KV backends: what moves a prefill's KV blocks to the decode engine, by name
(``kv_transfer.backend`` in the YAML).

A backend is a class registered in ``KV_BACKENDS``, constructed from its own
``settings_model``. It gives the engines their vLLM ``kv_transfer_config`` (a KV
connector of vLLM's API) and the router its side of the hand-over (``KVRouterSide``):
what to put in a prefill request's ``kv_transfer_params``, how to free a transfer
nobody will load, and the ledger it keeps, if any. The built-in ones are in
``kv_transfer/builtin_backends.py``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from kv_transfer.settings import KVRole, KVTransferConfig
from splitserve.config_base import StrictModel
from splitserve.registry import Registry


class KVRouterSide(Protocol):
    """The router's part in a backend's hand-over; it never touches KV tensors."""

    def prefill_params(self, consumer: str | None) -> dict[str, Any]:
        """``kv_transfer_params`` of a prefill request whose KV goes to ``consumer``."""

    def decode_params(self, handle: dict[str, Any] | None) -> dict[str, Any]:
        """``kv_transfer_params`` of the decode request that loads what the prefill request
        returned (``handle``, opaque to the router)."""

    def release(self, handle: dict[str, Any]) -> None:
        """Free a transfer nobody will load (its client left); fire and forget."""

    async def ledger_snapshot(self) -> dict[str, Any] | None:
        """The backend's ledger (transfers by outcome, what it holds; kv_transfer.metrics),
        or None if it keeps none. The transfer statistics come from the engines."""

    def shutdown(self) -> None:
        """The application is going away: free what the backend holds for it."""


class KVEngineSide(Protocol):
    """An engine host's part in a backend's hand-over: the host never reads a handle."""

    def consumer_name(self, vllm_config: Any) -> str | None:
        """How prefill requests name this engine as their KV's consumer, so that the KV is
        pushed to it ahead of the decode request; None where it is not one."""

    def check_request(self, kv_transfer_params: dict[str, Any], vllm_config: Any) -> None:
        """Raise ValueError, naming what differs, for KV this engine must not load; before
        the request is submitted, so that it fails instead of falling back silently."""


class KVBackend(Protocol):
    settings_model: ClassVar[type[StrictModel]]

    def __init__(self, settings: StrictModel) -> None: ...

    def engine_config(self, role: KVRole, engine_id: str | None = None) -> dict[str, Any]:
        """vLLM's ``kv_transfer_config`` engine argument for an engine of ``role``."""

    def router_side(self) -> KVRouterSide: ...

    def engine_side(self) -> KVEngineSide: ...

    def check_parallelism(self, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        """Raise ValueError for engine shapes this backend cannot hand over."""


KV_BACKENDS: Registry[type[KVBackend]] = Registry(
    "KV backend", __name__, builtins=("kv_transfer.builtin_backends", "kv_transfer.simulated")
)


def make_kv_backend(config: KVTransferConfig) -> KVBackend:
    return KV_BACKENDS.get(config.backend)(config.settings)
