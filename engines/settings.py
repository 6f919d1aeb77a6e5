"""An engine's settings: the model it serves, its pool's shape, its backend, and the
whole spec one engine starts from (``EngineSpec``), as the application builder hands
it over. The YAML's ``model:``, ``pools:`` and ``engine:`` blocks validate into these.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from engines.protocol import EngineRole
from kv_transfer.settings import KVTransferConfig
from splitserve.config_base import StrictModel


class ModelConfig(StrictModel):
    """Which weights to serve and how vLLM should hold them."""

    source: str = Field(
        "embedded",
        description="'embedded' (the tiny offline Llama), a local folder, or a Hugging Face id.",
    )
    served_model_name: str | None = Field(
        None, description="Name clients use in 'model'; defaults to the source's name."
    )
    dtype: str = "auto"
    max_model_len: int = Field(4096, gt=0)
    block_size: int | None = Field(None, gt=0, description="KV block size; engine default if None.")
    enforce_eager: bool = True
    seed: int = 0
    enable_prefix_caching: bool = True


class PlacementConfig(StrictModel):
    """Which Ray nodes a pool's replicas run on: nodes with these labels (``ray start
    --labels``) and enough of these custom resources (``ray start --resources``)."""

    node_labels: dict[str, str] = Field(
        default_factory=dict, description="e.g. {splitserve-pool: prefill}; every one must match."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom resources each replica takes, e.g. {prefill_node: 1}.",
    )

    @model_validator(mode="after")
    def _says_something(self) -> PlacementConfig:
        if not self.node_labels and not self.resources:
            raise ValueError("placement needs node_labels, resources or both")
        bad = {name: amount for name, amount in self.resources.items() if amount <= 0}
        if bad:
            raise ValueError(f"placement.resources must be positive amounts; got {bad}")
        reserved = sorted({"CPU", "GPU", "memory", "object_store_memory"} & set(self.resources))
        if reserved:
            raise ValueError(
                f"placement.resources names Ray's own {reserved}; use custom resource names"
            )
        return self


class PoolConfig(StrictModel):
    """A group of identical engine replicas with one role."""

    role: EngineRole = "mixed"
    replicas: int = Field(1, ge=1)
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    cpu_binds: list[str] | None = Field(
        None,
        description=(
            "CPU only: VLLM_CPU_OMP_THREADS_BIND per replica, e.g. ['0', '1'] or ['0|1'] for"
            " TP/PP=2. Unset: vLLM's automatic binding ('auto')."
        ),
    )
    kv_cache_gib: int = Field(1, ge=1, description="CPU only: KV cache GiB per engine.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="GPU only.")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra vllm AsyncEngineArgs fields, passed as is."
    )
    placement: PlacementConfig | None = Field(
        None,
        description="Run this pool's replicas on named Ray nodes (e.g. prefill on one"
        " node, decode on another). Placed pools run as engine replicas of their own.",
    )

    @model_validator(mode="after")
    def _binds_match_replicas(self) -> PoolConfig:
        if self.cpu_binds is not None and len(self.cpu_binds) != self.replicas:
            raise ValueError(
                f"cpu_binds has {len(self.cpu_binds)} entries but replicas is {self.replicas};"
                " give one bind per replica"
            )
        ranks = self.tensor_parallel_size * self.pipeline_parallel_size
        for bind in self.cpu_binds or []:
            if bind not in ("auto", "nobind") and len(bind.split("|")) != ranks:
                raise ValueError(
                    f"cpu_binds entry {bind!r} names {len(bind.split('|'))} rank(s) but the"
                    f" engine has tensor_parallel_size*pipeline_parallel_size = {ranks};"
                    " separate ranks with '|'"
                )
        return self

    @property
    def ranks_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class EngineBackendConfig(StrictModel):
    """What runs behind each engine replica: vLLM, or a token generator for benchmarks."""

    backend: str = Field(
        "vllm",
        description="A registered engine backend (engines.backends.ENGINE_BACKENDS): vllm, or"
        " synthetic: no model, every running request gets one token per step, to measure"
        " the router's relay capacity (bench/relay_capacity.py).",
    )
    step_interval_s: float = Field(
        0.0, ge=0, description="synthetic only: pause between steps; 0 runs them back to back."
    )

    @field_validator("backend")
    @classmethod
    def _registered(cls, name: str) -> str:
        from engines.backends import ENGINE_BACKENDS

        return ENGINE_BACKENDS.check(name)


class EngineSpec(StrictModel):
    """What one engine replica needs to start: its name, role, model and pool settings."""

    name: str
    role: EngineRole
    model: ModelConfig
    pool: PoolConfig
    accelerator: str
    # vLLM's kv_transfer_config for PD roles (the KV backend's connector), else None.
    kv_transfer: dict[str, Any] | None = None
    # The KV backend behind that connector: the host's side of the hand-over.
    kv_backend: KVTransferConfig | None = None
    # Publish the engine's KV events to its routers (router.prefix_signal: kv_events).
    kv_events: bool = False
    # Environment of this engine's own processes (its core binding, its KV cache size),
    # set while they are spawned: several engines may share one host process.
    process_env: dict[str, str] = Field(default_factory=dict)
    # GPU only, for engines that share a host process: the first of this engine's GPUs
    # among the host's (ray.get_gpu_ids()); None when the engine has the host's GPUs alone.
    device_offset: int | None = None
    backend: EngineBackendConfig = EngineBackendConfig()
