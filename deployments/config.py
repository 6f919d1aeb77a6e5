"""The validated form of a Serve YAML's ``args``: model, engine pools, router.

One pydantic object per concern. Errors name the field and the allowed values, and
``load_app_config`` reports them all at once with the YAML path they came from.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from engines.model_source import served_name_of
from engines.protocol import EngineRole
from engines.settings import (
    SIMULATED_ONLY_ENGINE_ARGS,
    EngineBackendConfig,
    ModelConfig,
    PoolConfig,
)
from engines.vllm_args import VLLM_CPU_OFFLOAD_REFUSAL, engine_arg_names
from kv_transfer.backend_registry import make_kv_backend
from kv_transfer.settings import KVTransferConfig
from router.settings import (
    AuthConfig,
    IngressSettings,
    PrefillPolicyConfig,
    QoSConfig,
    RouterConfig,
)
from splitserve.config_base import StrictModel

Shape = Literal["single", "dp", "tp", "pp", "pd", "auto"]
# Shapes whose engines hand KV over to each other: PD's pools, auto's auto pool.
KV_SHAPES = ("pd", "auto")
# Auto pools decide per request; without a policy named in the YAML they weigh the cost.
AUTO_PREFILL_POLICY = "cost"
Accelerator = Literal["cpu", "gpu"]


AT_LEAST_TWO = "at least two"


class ResourcesConfig(StrictModel):
    """Ray logical CPUs reserved per actor: fractional, so the engines keep the real cores."""

    router_num_cpus: float = Field(0.1, ge=0)
    engine_num_cpus: float = Field(0.1, ge=0)


class AppConfig(StrictModel):
    """Everything one served model needs: the ``args`` of a Serve YAML that serves one,
    or one entry of ``models:`` (``ApplicationConfig``) where it serves several."""

    RENAMED: ClassVar[dict[str, str]] = {"strategy": "shape", "split_policy": "prefill_policy"}
    shape: Shape
    accelerator: Accelerator = "cpu"
    model: ModelConfig = ModelConfig()
    pools: list[PoolConfig] = Field(min_length=1)
    router: RouterConfig = RouterConfig()
    engine: EngineBackendConfig = EngineBackendConfig()
    resources: ResourcesConfig = ResourcesConfig()
    kv_transfer: KVTransferConfig = Field(
        default_factory=KVTransferConfig,
        description="PD and auto only: the KV backend (backend: object_store) and its settings.",
    )
    prefill_policy: PrefillPolicyConfig = Field(
        default_factory=PrefillPolicyConfig,
        description="PD and auto only: the prefill policy (name: always, never, conditional,"
        " cost; auto defaults to cost) and its settings.",
    )
    qos: QoSConfig = QoSConfig()
    auth: AuthConfig = Field(
        default_factory=AuthConfig,
        description="API keys (by environment variable name, key_env, or as they are), each"
        " with its highest priority, queue cap and routes; and the routes open without one.",
    )

    @model_validator(mode="before")
    @classmethod
    def _auto_weighs_cost_by_default(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("shape") != "auto":
            return data
        policy = data.get("prefill_policy")
        if policy is None:
            return {**data, "prefill_policy": {"name": AUTO_PREFILL_POLICY}}
        if isinstance(policy, dict) and "name" not in policy:
            return {**data, "prefill_policy": {"name": AUTO_PREFILL_POLICY, **policy}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _simulated_engines_hand_over_simulated_kv(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("shape") not in KV_SHAPES:
            return data
        engine = data.get("engine")
        backend = engine.get("backend") if isinstance(engine, dict) else None
        if backend != "simulated" or "kv_transfer" in data:
            return data
        return {**data, "kv_transfer": {"backend": "simulated"}}

    @model_validator(mode="after")
    def _simulated_engines_pair_with_simulated_kv(self) -> AppConfig:
        if self.shape not in KV_SHAPES:
            return self
        simulated_engines = self.engine.backend == "simulated"
        if simulated_engines != (self.kv_transfer.backend == "simulated"):
            raise ValueError(
                "engine.backend 'simulated' and kv_transfer.backend 'simulated' go together:"
                f" got engine.backend {self.engine.backend!r} with kv_transfer.backend"
                f" {self.kv_transfer.backend!r}"
            )
        return self

    @model_validator(mode="after")
    def _simulated_pools_have_profiles_and_limits(self) -> AppConfig:
        if self.engine.backend != "simulated":
            return self
        from engines.simulated.settings import pool_limits, resolve_profile

        assert self.engine.profile is not None
        for pool in self.pools:
            profile = resolve_profile(
                self.engine.profile, pool.tensor_parallel_size, pool.pipeline_parallel_size
            )
            pool_limits(pool, self.model, profile)
        return self

    @model_validator(mode="after")
    def _only_simulated_engines_take_older_vllm_args(self) -> AppConfig:
        if self.engine.backend == "simulated":
            return self
        for pool in self.pools:
            for name in sorted(pool.engine_kwargs.keys() & SIMULATED_ONLY_ENGINE_ARGS.keys()):
                if name not in engine_arg_names():
                    raise ValueError(
                        f"the {pool.role} pool's engine_kwargs.{name} is"
                        f" {SIMULATED_ONLY_ENGINE_ARGS[name]}: the installed vLLM has no such"
                        f" argument, so engine.backend {self.engine.backend!r} cannot take it;"
                        " only engine.backend 'simulated' replays it"
                    )
        return self

    @model_validator(mode="after")
    def _kv_offloading_where_vllm_offloads(self) -> AppConfig:
        for pool in self.pools:
            if pool.kv_offloading_size is not None:
                _check_kv_offloading(self, pool)
        return self

    @model_validator(mode="after")
    def _synthetic_engines_serve_single_and_dp(self) -> AppConfig:
        if self.engine.backend != "synthetic":
            return self
        if self.shape not in ("single", "dp"):
            raise ValueError(
                f"engine.backend 'synthetic' serves shapes single and dp, not {self.shape!r}"
            )
        return self

    @model_validator(mode="after")
    def _handed_over_requests_can_continue(self) -> AppConfig:
        if self.shape not in ("pd", "auto"):
            return self
        for pool in self.pools:
            if "speculative_config" in pool.engine_kwargs:
                raise ValueError(
                    f"shape {self.shape!r} hands requests between engines, which"
                    " continue them with a logits processor (engines/continuation.py);"
                    " vLLM refuses logits processors beside speculative decoding: drop"
                    f" speculative_config from the {pool.role} pool's engine_kwargs"
                )
        return self

    @model_validator(mode="after")
    def _pools_fit_shape(self) -> AppConfig:
        roles = sorted(pool.role for pool in self.pools)
        if self.shape == "pd":
            if roles != ["decode", "prefill"]:
                raise ValueError(
                    f"shape 'pd' needs exactly one 'prefill' and one 'decode' pool, got {roles}"
                )
            _check_kv_layouts_match(self.pool("prefill"), self.pool("decode"))
            prefill = self.pool("prefill")
            make_kv_backend(self.kv_transfer).check_parallelism(
                prefill.tensor_parallel_size, prefill.pipeline_parallel_size
            )
            return self._check_replica_choice_roles()
        if roles != ["mixed"]:
            raise ValueError(f"shape {self.shape!r} needs one 'mixed' pool, got {roles}")
        if self.shape == "auto":
            return self._check_auto_pool()
        for block in ("prefill_policy", "kv_transfer"):
            if block in self.model_fields_set:
                raise ValueError(f"{block} is for shapes 'pd' and 'auto', not {self.shape!r}")
        self._check_replica_choice_roles()
        pool = self.pools[0]
        # Per shape: (replicas, tensor_parallel_size, pipeline_parallel_size), each
        # exactly this number, AT_LEAST_TWO, or None for any (DP of tensor-parallel engines).
        expected: tuple[int | str | None, ...] = {  # type: ignore[assignment]
            "single": (1, 1, 1),
            "tp": (1, AT_LEAST_TWO, 1),
            "pp": (1, 1, AT_LEAST_TWO),
            "dp": (AT_LEAST_TWO, None, 1),
        }[self.shape]
        if pool.autoscaling is not None and self.shape != "dp":
            raise ValueError(
                f"shape {self.shape!r} serves one engine; pools grow and shrink"
                " (pools[].autoscaling) under shapes dp, pd and auto"
            )
        actual = (pool.most_replicas, pool.tensor_parallel_size, pool.pipeline_parallel_size)
        names = ("replicas", "tensor_parallel_size", "pipeline_parallel_size")
        for name, want, got in zip(names, expected, actual, strict=True):
            if want == AT_LEAST_TWO and got < 2:
                raise ValueError(f"shape {self.shape!r} needs {name} >= 2, got {got}")
            if isinstance(want, int) and got != want:
                raise ValueError(f"shape {self.shape!r} needs {name} = {want}, got {got}")
        return self

    def _check_auto_pool(self) -> AppConfig:
        """Every engine of auto's one pool prefills for the others and decodes theirs."""
        pool = self.pools[0]
        if pool.most_replicas < 2:
            raise ValueError(
                "shape 'auto' needs replicas >= 2 (an engine to hand KV to),"
                f" got {pool.most_replicas}"
            )
        make_kv_backend(self.kv_transfer).check_parallelism(
            pool.tensor_parallel_size, pool.pipeline_parallel_size
        )
        return self._check_replica_choice_roles()

    @property
    def engine_replicas(self) -> int:
        return sum(pool.replicas for pool in self.pools)

    @property
    def hosts_engines_in_router(self) -> bool:
        """The router's process runs every engine's front end. ``auto`` does so only where
        that was measured to win (docs/DECISIONS.md): engines on CPUs, whose compute takes
        the cores that a front-end process each would need. GPU engines get a replica and
        a front end each, so that one GIL does not cap their tokens; placed and scaled
        pools always run apart, as replicas that Serve places."""
        setting = self.router.engine_in_router
        if isinstance(setting, bool):
            return setting
        if self.placed or self.scaled or self.grouped:
            return False
        return self.accelerator == "cpu"

    @property
    def placed(self) -> bool:
        return any(pool.placement is not None for pool in self.pools)

    @property
    def grouped(self) -> bool:
        """Some pool puts several engines in one process of their own."""
        return any(pool.engines_per_process > 1 for pool in self.pools)

    @property
    def scaled(self) -> bool:
        """Some pool grows and shrinks: Serve, not the router, starts its engines."""
        return any(pool.autoscaling is not None for pool in self.pools)

    @model_validator(mode="after")
    def _placed_pools_run_apart(self) -> AppConfig:
        if self.placed and self.router.engine_in_router is True:
            raise ValueError(
                "pools placed on named nodes run as engine replicas of their own, each on its"
                " node: set router.engine_in_router to auto or false, not true"
            )
        if self.scaled and self.router.engine_in_router is True:
            raise ValueError(
                "pools with autoscaling run as engine replicas of their own, which Serve adds"
                " and removes: set router.engine_in_router to auto or false, not true"
            )
        if self.grouped and self.router.engine_in_router is True:
            raise ValueError(
                "pools with engines_per_process > 1 run in engine processes of their own:"
                " set router.engine_in_router to auto or false, not true"
            )
        return self

    def _check_replica_choice_roles(self) -> AppConfig:
        choice = self.router.replica_choice
        if isinstance(choice, dict):
            roles = {pool.role for pool in self.pools}
            unknown = sorted(set(choice) - roles)
            if unknown:
                raise ValueError(
                    f"router.replica_choice names roles {unknown} this shape has no pool for;"
                    f" its pools are {sorted(roles)}"
                )
        return self

    def pool(self, role: EngineRole) -> PoolConfig:
        return next(pool for pool in self.pools if pool.role == role)

    @property
    def served_name(self) -> str:
        """The name clients route by (``model`` in a request)."""
        return served_name_of(self.model)

    def ingress_settings(self, http_host: str | None = None) -> IngressSettings:
        """What the router process is handed: its own settings objects, validated here;
        ``http_host``: where Serve listens, if known."""
        return IngressSettings(
            shape=self.shape,
            model=self.model,
            router=self.router,
            prefill_policy=_stretched_prefill_policy(self.prefill_policy, self.engine.time_scale),
            qos=_stretched_qos(self.qos, self.engine.time_scale),
            kv_transfer=self.kv_transfer if self.shape in KV_SHAPES else None,
            engine_backend=self.engine.backend,
            auth=self.auth,
            http_host=http_host,
            generating_engine_kwargs=self.pool(
                "decode" if self.shape == "pd" else "mixed"
            ).engine_kwargs,
        )


def _stretched_qos(qos: QoSConfig, time_scale: float) -> QoSConfig:
    """The QoS objectives in the router's clock: the YAML gives them in the engines' own
    time, and engines ``time_scale`` times slower (simulated) take that much longer to
    meet them. Retry-After stays the client's."""
    if time_scale == 1.0:
        return qos
    stretched = {name: value * time_scale for name, value in qos.early_rejection_s.items()}
    update = {"ttft_slo_s": qos.ttft_slo_s * time_scale, "early_rejection_s": stretched}
    return qos.model_copy(update=update)


def _stretched_prefill_policy(
    policy: PrefillPolicyConfig, time_scale: float
) -> PrefillPolicyConfig:
    """The prefill policy's times (its ``*_s`` fields) in the router's clock, as QoS's."""
    if time_scale == 1.0:
        return policy
    fields = policy.settings.model_dump()
    update = {
        name: value * time_scale
        for name, value in fields.items()
        if name.endswith("_s") and isinstance(value, int | float) and not isinstance(value, bool)
    }
    return policy.model_copy(update={"settings": policy.settings.model_copy(update=update)})


# Engine arguments that shape the KV cache: prefill and decode must agree on all of them,
# or the transferred blocks would be read with the wrong layout. (The model's dtype and
# block size are model fields, shared by every pool.)
KV_LAYOUT_ENGINE_KWARGS = ("kv_cache_dtype",)


def _check_kv_offloading(config: AppConfig, pool: PoolConfig) -> None:
    """Refuse, before anything starts, a kv_offloading_size vLLM would fail or misapply."""
    where = f"the {pool.role} pool's kv_offloading_size"
    if config.engine.backend != "vllm":
        raise ValueError(
            f"{where} is vLLM's KV offloading; engine.backend {config.engine.backend!r} does"
            " not model it: unset it"
        )
    native = pool.kv_offloading_backend == "native"
    if config.accelerator == "cpu" and native:
        raise ValueError(
            f"{where}: vLLM cannot offload a CPU engine's KV (it refuses at start-up:"
            f" {VLLM_CPU_OFFLOAD_REFUSAL!r}); unset it, or serve with accelerator: gpu"
        )
    if config.accelerator == "cpu" and not native and importlib.util.find_spec("lmcache") is None:
        # On GPUs the engines' nodes may have packages this process lacks.
        raise ValueError(
            f"{where}: kv_offloading_backend 'lmcache' needs the lmcache package, which"
            " vLLM's LMCache connector imports and this machine does not have"
        )
    if config.shape in KV_SHAPES:
        # vLLM turns the size into a kv_transfer_config of its own, which would replace
        # the hand-over's connector; both need vLLM's MultiConnector, not built yet.
        raise ValueError(
            f"{where}: shape {config.shape!r} hands KV over through a connector of ours,"
            " and vLLM's offloading would replace it (combining both through vLLM's"
            " MultiConnector is not built yet); offload in single, tp, pp or dp"
        )


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


# Settings of the router's own process, one for all the models it routes: where it runs
# and how it reads a body, which happens before the body names its model.
ROUTER_PROCESS_FIELDS = (
    "placement",
    "max_request_bytes",
    "inline_prepare_max_bytes",
    "prepare_threads",
)
# What ``models:`` entries take from the application's ``args`` unless they set it.
SHARED_MODEL_FIELDS = ("accelerator", "resources", "auth")


class ApplicationConfig(StrictModel):
    """One Serve application: the models it serves (each with its own pools, split and
    QoS) behind one router, and the API keys that guard them all. A YAML without a
    ``models:`` list serves one model, whose ``args`` are this application's."""

    models: list[AppConfig] = Field(min_length=1)
    auth: AuthConfig = Field(default_factory=AuthConfig)

    @model_validator(mode="before")
    @classmethod
    def _one_model_or_a_list(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "models" not in data:
            return {"models": [data], "auth": data.get("auth", {})}
        models = data["models"]
        if not isinstance(models, list):
            return data  # pydantic names the type error
        unexpected = sorted(set(data) - {"models", *SHARED_MODEL_FIELDS})
        if unexpected:
            raise ValueError(
                f"with a models: list, {unexpected} belong inside each model's entry; the"
                f" application's own args are {['models', *SHARED_MODEL_FIELDS]}"
            )
        shared = {name: data[name] for name in SHARED_MODEL_FIELDS if name in data}
        return {
            "models": [_with_shared(entry, shared) for entry in models],
            "auth": data.get("auth", {}),
        }

    @model_validator(mode="after")
    def _models_apart(self) -> ApplicationConfig:
        names = [model.served_name for model in self.models]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(
                f"models: {repeated} served twice; set model.served_model_name to tell them apart"
            )
        slugs = [deployment_slug(name) for name in names]
        if len(set(slugs)) != len(slugs):
            raise ValueError(f"models: {names} give clashing engine names {slugs}; rename one")
        first = self.models[0].router
        for model in self.models[1:]:
            for field in ROUTER_PROCESS_FIELDS:
                if getattr(model.router, field) != getattr(first, field):
                    raise ValueError(
                        f"models: router.{field} is the router process's own, one for every"
                        f" model, but {model.served_name!r} sets it otherwise than"
                        f" {self.models[0].served_name!r}"
                    )
        return self

    @property
    def several(self) -> bool:
        return len(self.models) > 1

    def engine_prefix(self, model: AppConfig) -> str:
        """What a model's engine names end in: nothing for one model (engine-0), its name
        for several (engine-tiny-b-0), so that every Serve deployment is named once."""
        return f"-{deployment_slug(model.served_name)}" if self.several else ""


def _with_shared(entry: Any, shared: dict[str, Any]) -> Any:
    if not isinstance(entry, dict):
        return entry
    if "auth" in entry:
        raise ValueError(
            "models[].auth: API keys guard the whole application; set auth beside models:"
        )
    return {**shared, **entry}


def deployment_slug(served_name: str) -> str:
    """A served name as Serve deployment names may spell it (meta-llama/X -> meta-llama-X)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", served_name).strip("-")


class ConfigError(ValueError):
    """A config that cannot be served, with every problem named."""


def parse_app_config(args: dict[str, Any], origin: str = "args") -> AppConfig:
    try:
        return AppConfig.model_validate(args)
    except ValidationError as error:
        raise ConfigError(_describe(error, origin)) from None


def parse_application(args: dict[str, Any], origin: str = "args") -> ApplicationConfig:
    try:
        return ApplicationConfig.model_validate(args)
    except ValidationError as error:
        raise ConfigError(_describe(error, origin)) from None


def load_app_config(path: Path | str, app_index: int = 0) -> AppConfig:
    """The AppConfig of one application of a Serve YAML file that serves one model."""
    args, origin = _application_args(path, app_index)
    return parse_app_config(args, origin=origin)


def load_application(path: Path | str, app_index: int = 0) -> ApplicationConfig:
    """Every model of one application of a Serve YAML file."""
    args, origin = _application_args(path, app_index)
    return parse_application(args, origin=origin)


def _application_args(path: Path | str, app_index: int) -> tuple[dict[str, Any], str]:
    document = yaml.safe_load(Path(path).read_text())
    try:
        args = document["applications"][app_index]["args"]
    except (KeyError, IndexError, TypeError):
        raise ConfigError(f"{path}: no applications[{app_index}].args") from None
    return args, f"{path}: applications[{app_index}].args"


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
        message = problem["msg"].removeprefix("Value error, ")
        # A policy's or backend's own settings name their fields themselves.
        lines.append(
            f"  - {message}" if message.startswith(f"{where}.") else f"  - {where}: {message}"
        )
    return "\n".join(lines)
