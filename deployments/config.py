"""The validated shape of a Serve YAML's ``args``: model, engine pools, router.

One pydantic object per concern. Errors name the field and the allowed values, and
``load_app_config`` reports them all at once with the YAML path they came from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deployments.protocol import EngineRole
from kv_transfer.settings import ConnectorSettings
from router.settings import (
    PrefixAffinityConfig,
    QoSConfig,
    ReplicaChoiceName,
    SplitPolicyConfig,
)

Strategy = Literal["single", "dp", "tp", "pp", "pd"]
Accelerator = Literal["cpu", "gpu"]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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


class ResourcesConfig(StrictModel):
    """Ray logical CPUs reserved per actor: fractional, so the engines keep the real cores."""

    router_num_cpus: float = Field(0.1, ge=0)
    engine_num_cpus: float = Field(0.1, ge=0)


EngineBackend = Literal["vllm", "synthetic"]


class EngineBackendConfig(StrictModel):
    """What runs behind each engine replica: vLLM, or a token generator for benchmarks."""

    backend: EngineBackend = Field(
        "vllm",
        description="vllm, or synthetic: no model, every running request gets one token per"
        " step, to measure the router's relay capacity (bench/relay_capacity.py).",
    )
    step_interval_s: float = Field(
        0.0, ge=0, description="synthetic only: pause between steps; 0 runs them back to back."
    )


class RouterConfig(StrictModel):
    replica_choice: ReplicaChoiceName | dict[EngineRole, ReplicaChoiceName] = Field(
        "round_robin",
        description="One policy for every pool, or one per role, e.g. {prefill: least_loaded,"
        " decode: prefix_affinity}.",
    )
    prefix_affinity: PrefixAffinityConfig = PrefixAffinityConfig()
    request_timeout_s: float = Field(600.0, gt=0)
    health_check_timeout_s: float = Field(5.0, gt=0)
    unhealthy_after_failed_polls: int = Field(
        3, ge=1, description="Consecutive failed stats polls before a replica is skipped."
    )
    submit_timeout_s: float = Field(
        5.0, gt=0, description="An engine replica that takes longer to accept is unhealthy."
    )
    stats_interval_s: float = Field(
        0.2, gt=0, description="How often the router polls every engine for its load."
    )
    engine_restart_attempts: int = Field(
        3,
        ge=1,
        description="An engine in the router's process that dies is restarted there; after"
        " this many failed starts in a row the router fails its health check and Serve"
        " restarts it.",
    )
    engine_in_router: Literal["auto"] | bool = Field(
        "auto",
        description="Host every engine in the router's own process, each engine core in"
        " processes of its own (vLLM's data-parallel layout): true, false (one Serve"
        " replica per engine, reached through Ray), or auto (true).",
    )


class AppConfig(StrictModel):
    """Everything one splitserve application needs; the ``args`` of a Serve YAML."""

    strategy: Strategy
    accelerator: Accelerator = "cpu"
    model: ModelConfig = ModelConfig()
    pools: list[PoolConfig] = Field(min_length=1)
    router: RouterConfig = RouterConfig()
    engine: EngineBackendConfig = EngineBackendConfig()
    resources: ResourcesConfig = ResourcesConfig()
    kv_transfer: ConnectorSettings = Field(
        default_factory=ConnectorSettings,
        description=(
            "PD only: the object-store KV connector (namespace, ttl_s, claim_wait_s, push_wait_s)."
        ),
    )
    split_policy: SplitPolicyConfig = Field(
        default_factory=SplitPolicyConfig,
        description="PD only: where each prompt is prefilled (always, never, conditional).",
    )
    qos: QoSConfig = QoSConfig()

    @model_validator(mode="after")
    def _synthetic_engines_in_router(self) -> AppConfig:
        if self.engine.backend != "synthetic":
            return self
        if self.strategy not in ("single", "dp"):
            raise ValueError(
                f"engine.backend 'synthetic' serves strategies single and dp, not {self.strategy!r}"
            )
        if not self.hosts_engines_in_router:
            raise ValueError(
                "engine.backend 'synthetic' needs router.engine_in_router true or auto"
            )
        return self

    @model_validator(mode="after")
    def _pools_fit_strategy(self) -> AppConfig:
        roles = sorted(pool.role for pool in self.pools)
        if self.strategy == "pd":
            if roles != ["decode", "prefill"]:
                raise ValueError(
                    f"strategy 'pd' needs exactly one 'prefill' and one 'decode' pool, got {roles}"
                )
            _check_kv_layouts_match(self.pool("prefill"), self.pool("decode"))
            return self._check_replica_choice_roles()
        if roles != ["mixed"]:
            raise ValueError(f"strategy {self.strategy!r} needs one 'mixed' pool, got {roles}")
        # Compared with the default, not by presence: the router re-validates a full dump.
        if self.split_policy != SplitPolicyConfig():
            raise ValueError(f"split_policy is for strategy 'pd', not {self.strategy!r}")
        self._check_replica_choice_roles()
        pool = self.pools[0]
        expected = {
            "single": (1, 1, 1),
            "tp": (1, None, 1),
            "pp": (1, 1, None),
            "dp": (None, 1, 1),
        }[self.strategy]
        actual = (pool.replicas, pool.tensor_parallel_size, pool.pipeline_parallel_size)
        names = ("replicas", "tensor_parallel_size", "pipeline_parallel_size")
        for name, want, got in zip(names, expected, actual, strict=True):
            if want is None and got < 2:
                raise ValueError(f"strategy {self.strategy!r} needs {name} >= 2, got {got}")
            if want is not None and got != want:
                raise ValueError(f"strategy {self.strategy!r} needs {name} = {want}, got {got}")
        return self

    @property
    def engine_replicas(self) -> int:
        return sum(pool.replicas for pool in self.pools)

    @property
    def hosts_engines_in_router(self) -> bool:
        """The router's process runs every engine's front end, which saves every token a
        hop between processes through Ray (docs/DECISIONS.md)."""
        return self.router.engine_in_router in ("auto", True)

    def _check_replica_choice_roles(self) -> AppConfig:
        choice = self.router.replica_choice
        if isinstance(choice, dict):
            roles = {pool.role for pool in self.pools}
            unknown = sorted(set(choice) - roles)
            if unknown:
                raise ValueError(
                    f"router.replica_choice names roles {unknown} this strategy has no pool for;"
                    f" its pools are {sorted(roles)}"
                )
        return self

    def pool(self, role: EngineRole) -> PoolConfig:
        return next(pool for pool in self.pools if pool.role == role)

    def replica_choice(self, role: EngineRole) -> ReplicaChoiceName:
        choice = self.router.replica_choice
        return choice if isinstance(choice, str) else choice.get(role, "round_robin")


# Engine settings that shape the KV cache: prefill and decode must agree on all of them,
# or the transferred blocks would be read with the wrong layout.
KV_LAYOUT_ENGINE_KWARGS = ("block_size", "dtype", "kv_cache_dtype")


def _check_kv_layouts_match(prefill: PoolConfig, decode: PoolConfig) -> None:
    differences = []
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(prefill, name) != getattr(decode, name):
            differences.append(f"{name} {getattr(prefill, name)} != {getattr(decode, name)}")
    for name in KV_LAYOUT_ENGINE_KWARGS:
        ours, theirs = prefill.engine_kwargs.get(name), decode.engine_kwargs.get(name)
        if ours != theirs:
            differences.append(f"engine_kwargs.{name} {ours!r} != {theirs!r}")
    if differences:
        raise ValueError(
            "prefill and decode pools must share one KV layout, but (prefill != decode): "
            + "; ".join(differences)
        )
    if prefill.pipeline_parallel_size > 1:
        raise ValueError("the object-store KV connector does not support pipeline parallelism")


class ConfigError(ValueError):
    """A config that cannot be served, with every problem named."""


def parse_app_config(args: dict[str, Any], origin: str = "args") -> AppConfig:
    try:
        return AppConfig.model_validate(args)
    except ValidationError as error:
        raise ConfigError(_describe(error, origin)) from None


def load_app_config(path: Path | str, app_index: int = 0) -> AppConfig:
    """The AppConfig of one application of a Serve YAML file."""
    document = yaml.safe_load(Path(path).read_text())
    try:
        args = document["applications"][app_index]["args"]
    except (KeyError, IndexError, TypeError):
        raise ConfigError(f"{path}: no applications[{app_index}].args") from None
    return parse_app_config(args, origin=f"{path}: applications[{app_index}].args")


# Names of the Serve deployments that host engines when they run apart from the router.
ENGINE_DEPLOYMENT_PREFIXES = ("engine-", "prefill-", "decode-")
# Serve settings that would give an engine deployment more (or fewer) than one replica.
REPLICA_COUNT_OVERRIDES = ("num_replicas", "autoscaling_config", "max_replicas_per_node")


def refuse_engine_overrides(path: Path | str) -> None:
    """Refuse a Serve YAML that scales an engine deployment by Serve's own overrides.

    The router addresses each engine deployment by name and holds one long-lived delta
    stream to it: a second replica behind that name would take submits whose deltas
    travel on the other replica's stream. Engine counts belong in ``pools[].replicas``.
    """
    document = yaml.safe_load(Path(path).read_text()) or {}
    problems = []
    for index, application in enumerate(document.get("applications") or []):
        for deployment in application.get("deployments") or []:
            name = str(deployment.get("name", ""))
            if not name.startswith(ENGINE_DEPLOYMENT_PREFIXES):
                continue
            for key in REPLICA_COUNT_OVERRIDES:
                if key in deployment:
                    problems.append(
                        f"  - applications[{index}].deployments[{name}].{key}: engine"
                        " deployments are scaled by args.pools[].replicas (each engine"
                        " replica is its own deployment), not by Serve overrides"
                    )
    if problems:
        raise ConfigError("\n".join([f"invalid splitserve config in {path}:", *problems]))


def _describe(error: ValidationError, origin: str) -> str:
    lines = [f"invalid splitserve config in {origin}:"]
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"]) or "(top level)"
        lines.append(f"  - {where}: {problem['msg']}")
    return "\n".join(lines)
