"""``kv_transfer.backend: simulated``: the hand-over of simulated engines
(engines/simulated/host.py). The prefill engine's answer names how many prompt tokens
it computed; the decode engine waits its profile's link time for that much KV. Nothing
is stored, so there is nothing to release and no ledger."""

from __future__ import annotations

from typing import Any, ClassVar

from kv_transfer.backend_registry import KV_BACKENDS
from kv_transfer.builtin_backends import PassiveEngineSide, PlainRouterSide
from kv_transfer.settings import KVRole, SimulatedKVSettings
from splitserve.config_base import StrictModel


@KV_BACKENDS.register("simulated")
class SimulatedKVBackend:
    settings_model: ClassVar[type[StrictModel]] = SimulatedKVSettings

    def __init__(self, settings: StrictModel) -> None:
        self.settings = settings

    def engine_config(self, role: KVRole, engine_id: str | None = None) -> dict[str, Any]:
        return {"kv_role": role}

    def router_side(self) -> PlainRouterSide:
        return PlainRouterSide()

    def engine_side(self) -> PassiveEngineSide:
        return PassiveEngineSide()  # simulated engines name no consumer and read no handle

    def check_parallelism(self, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        return None
