"""Build the Ray Serve application graph from a validated config.

``serve run deployments/dp.yaml`` calls ``build_app`` with the YAML's ``args``: one
Serve deployment per engine replica (so the router, not Serve, picks the replica and
each replica keeps its own queue), and the router ingress bound to their handles; or,
with ``router.engine_in_router`` (by default for CPU engines), every engine in the
router's own process, as vLLM's API server holds its data-parallel engines: one front
end, each engine core in processes of its own, tokens over vLLM's ZMQ sockets instead
of Ray.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from ray.serve.deployment import Deployment

from deployments.config import KV_SHAPES, AppConfig, ApplicationConfig, parse_application
from engines.orphan_guard import ENV_FLAG as ORPHAN_GUARD_ENV
from engines.settings import CPU_BIND_ENV, ENGINE_NAME_ENV, EngineSpec, PlacementConfig, PoolConfig
from kv_transfer.backend_registry import make_kv_backend
from kv_transfer.settings import KVRole
from router.settings import ModelBinding, ScaledPoolSettings
from splitserve.packaging import check_top_level_packages

logger = logging.getLogger("splitserve.deployments")

# The build names the replicas' classes by import path, and each replica imports its
# own. Importing them here would import vLLM into Serve's build task: 10-13 s of every
# start, during which Serve's proxy answers 404 (docs/DECISIONS.md).
ROUTER_CLASS = "router.http.ingress.Router"
ENGINE_REPLICA_CLASS = "engines.host.EngineReplica"
ENGINE_GROUP_CLASS = "engines.host.EngineGroupReplica"
# Serve's default (5) would queue requests in Serve's handles, away from our policies.
MAX_ONGOING_REQUESTS = 4096
# How often Serve asks whatever process hosts an engine whether that engine is alive.
ENGINE_HEALTH_CHECK_PERIOD_S = 5
# A scaled pool: Serve's autoscaling policy and the request router that tells routers
# which replicas run (both named by path: Serve imports them where they run).
SCALED_POOL_POLICY = "engines.pool_scaling:SloPolicy"
SCALED_POOL_REQUEST_ROUTER = "router.pool.membership:PoolMembership"
# How often each engine of a scaled pool reports its measurements to Serve, and the
# span Serve averages them over (each engine already measures over its window_s).
SCALING_METRICS_INTERVAL_S = 1.0
SCALING_LOOK_BACK_S = 2.0
# What an engine takes to stop once drained (vLLM gives its core up to 5 s): Serve
# kills a replica that takes longer than the drain and this together.
ENGINE_STOP_S = 15.0

# Ray Serve settings for our replicas, read by Serve when the replica process starts.
# Serve's defaults isolate arbitrary user code: it runs on a second thread and event
# loop, and handle routing on a third, so every streamed item (each SSE token to the
# proxy, each engine step to the router) crosses threads. Our replicas never block
# their loop (prompt tokenization is the longest synchronous step, under a millisecond
# for chat-sized prompts; the engine's constructor blocks, but before it serves), so
# they run on the replica's main loop (bench/overhead.py; docs/DECISIONS.md).
# Serve's logging stays as it is: it costs per request, not per token, and
# RAY_SERVE_LOG_TO_STDERR=0 would hide replica errors from the `serve run` console.
SERVE_REPLICA_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


class _NamedByPath:
    """Stands in for a replica class until ``.options`` names it by import path."""


def deployment_by_path(import_path: str, name: str, **options: Any) -> Deployment:
    """A Serve deployment of the class at ``import_path``, which only its replicas import."""
    stand_in = serve.deployment(_NamedByPath, name=name, **options)
    return stand_in.options(func_or_class=import_path)  # type: ignore[attr-defined]


def pool_name(pool: PoolConfig, suffix: str = "") -> str:
    """What a pool's engines are named after: ``engine`` (mixed), ``prefill``, ``decode``;
    with ``suffix`` (a model's, where an application serves several) ``engine-tiny-b``."""
    return ("engine" if pool.role == "mixed" else pool.role) + suffix


def engine_names(config: AppConfig, suffix: str = "") -> list[tuple[str, PoolConfig, int]]:
    """Stable replica names of the pools of fixed size: ``engine-0``, ``engine-1`` or
    ``prefill-0``, ``decode-0``, each with its pool and its index there (which of the
    pool's cpu_binds). Scaled pools' engines are named by Serve's replica ids instead."""
    names: list[tuple[str, PoolConfig, int]] = []
    for pool in config.pools:
        if pool.autoscaling is None:
            prefix = pool_name(pool, suffix)
            names.extend((f"{prefix}-{index}", pool, index) for index in range(pool.replicas))
    return names


def scaled_pool_settings(config: AppConfig, suffix: str = "") -> list[ScaledPoolSettings]:
    return [
        ScaledPoolSettings(
            deployment=f"{pool_name(pool, suffix)}-pool",
            name=pool_name(pool, suffix),
            role=pool.role,
            drain_timeout_s=pool.autoscaling.drain_timeout_s,
        )
        for pool in config.pools
        if pool.autoscaling is not None
    ]


# Environment of every process that hosts engines, inherited by vLLM's processes.
ENGINE_HOST_ENV = {**SERVE_REPLICA_ENV, "VLLM_LOGGING_LEVEL": "WARNING", ORPHAN_GUARD_ENV: "1"}


# An eager engine's processes run no torch.compile at all. vLLM compiles a few helpers
# whatever enforce_eager says (the logprob ranks, TP's masked embedding lookup) with
# inductor, which on a CPU runs g++: the first logprobs request on a fresh engine took
# 10 s instead of 0.03 s (bench/first_logprobs.py), and a warm cache still leaves about
# 2 s per new process. The helpers are integer counts and masks: eager gives the same ids.
NO_COMPILE_ENV = {"TORCHDYNAMO_DISABLE": "1"}


def engine_process_env(config: AppConfig, pool: PoolConfig, replica_index: int) -> dict[str, str]:
    """What one engine's own processes need in their environment: cores, KV size, and
    no compiling where the engine is eager on a CPU."""
    env: dict[str, str] = {}
    if config.accelerator == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(pool.kv_cache_gib)
        if pool.cpu_binds is not None:
            env[CPU_BIND_ENV] = pool.cpu_binds[replica_index]
        if config.model.eager_on(config.accelerator):
            env.update(NO_COMPILE_ENV)
    return env


def engine_spec(
    config: AppConfig,
    name: str,
    pool: PoolConfig,
    replica_index: int,
    device_offset: int | None = None,
) -> EngineSpec:
    return EngineSpec(
        name=name,
        role=pool.role,
        model=config.model,
        pool=pool,
        accelerator=config.accelerator,
        kv_transfer=_kv_transfer_config(config, pool),
        kv_backend=config.kv_transfer if config.shape in KV_SHAPES else None,
        kv_events=config.router.prefix_signal == "kv_events",
        process_env={ENGINE_NAME_ENV: name, **engine_process_env(config, pool, replica_index)},
        device_offset=device_offset,
        backend=config.engine,
    )


def engine_actor_options(num_cpus: float, num_gpus: int, gpu: bool) -> dict[str, Any]:
    """Ray options of a process that hosts engines: its environment and devices."""
    actor_options: dict[str, Any] = {
        "num_cpus": num_cpus,
        "runtime_env": {"env_vars": ENGINE_HOST_ENV},
    }
    if gpu:
        actor_options["num_gpus"] = num_gpus
    return actor_options


def place(actor_options: dict[str, Any], placement: PlacementConfig | None) -> None:
    """Ray schedules the replica on a node that has these labels and resources."""
    if placement is None:
        return
    if placement.node_labels:
        actor_options["label_selector"] = dict(placement.node_labels)
    if placement.resources:
        actor_options["resources"] = dict(placement.resources)


def build_engine(config: AppConfig, name: str, pool: PoolConfig, replica_index: int) -> Application:
    spec = engine_spec(config, name, pool, replica_index)
    return _engine_process(config, ENGINE_REPLICA_CLASS, name, pool, engines=1).bind(spec)


def _engine_process(
    config: AppConfig, import_path: str, name: str, pool: PoolConfig, engines: int
) -> Deployment:
    """One Serve replica that hosts ``engines`` of a fixed pool, with their CPUs and devices."""
    actor_options = engine_actor_options(
        config.resources.engine_num_cpus * engines,
        pool.ranks_per_replica * engines,
        config.accelerator == "gpu",
    )
    place(actor_options, pool.placement)
    return deployment_by_path(
        import_path,
        name,
        num_replicas=1,
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        health_check_period_s=ENGINE_HEALTH_CHECK_PERIOD_S,
        ray_actor_options=actor_options,
    )


def engine_groups(
    config: AppConfig, suffix: str = ""
) -> list[tuple[str, list[tuple[str, PoolConfig, int]]]]:
    """The engines of fixed-size pools by the process that hosts them: a deployment name
    and its engines. One engine per process is named after its engine (``engine-0``); a
    pool's ``engines_per_process`` engines share ``engine-group-0``, ``engine-group-1``."""
    groups: list[tuple[str, list[tuple[str, PoolConfig, int]]]] = []
    names = engine_names(config, suffix)
    for pool in config.pools:
        members = [item for item in names if item[1] is pool]
        size = pool.engines_per_process
        if size == 1:
            groups.extend((item[0], [item]) for item in members)
            continue
        prefix = pool_name(pool, suffix)
        for start in range(0, len(members), size):
            groups.append((f"{prefix}-group-{start // size}", members[start : start + size]))
    return groups


def build_engine_group(
    config: AppConfig, name: str, members: list[tuple[str, PoolConfig, int]]
) -> Application:
    """One process for several engines of one pool, each with its own transport."""
    pool = members[0][1]
    specs = [
        engine_spec(config, engine, pool, index, position * pool.ranks_per_replica)
        for position, (engine, pool, index) in enumerate(members)
    ]
    group = _engine_process(config, ENGINE_GROUP_CLASS, name, pool, engines=len(members))
    return group.bind(specs)


def build_scaled_pool(config: AppConfig, settings: ScaledPoolSettings) -> Application:
    """One Serve deployment for the whole pool, grown and shrunk by Serve's autoscaling
    from the SLOs its engines measure (engines/pool_scaling.py)."""
    pool = config.pool(settings.role)  # type: ignore[arg-type]
    scaling = pool.autoscaling
    assert scaling is not None
    actor_options = engine_actor_options(
        config.resources.engine_num_cpus, pool.ranks_per_replica, config.accelerator == "gpu"
    )
    place(actor_options, pool.placement)
    policy_kwargs = {
        "ttft_slo_s": scaling.ttft_slo_s or config.qos.ttft_slo_s,
        "tpot_slo_s": scaling.tpot_slo_s,
        "scale_up_at": scaling.scale_up_at,
        "scale_down_at": scaling.scale_down_at,
    }
    engines = deployment_by_path(
        ENGINE_REPLICA_CLASS,
        settings.deployment,
        autoscaling_config={
            "min_replicas": scaling.min_replicas,
            "max_replicas": scaling.max_replicas,
            "initial_replicas": pool.replicas,
            "upscale_delay_s": scaling.upscale_delay_s,
            "downscale_delay_s": scaling.downscale_delay_s,
            "metrics_interval_s": SCALING_METRICS_INTERVAL_S,
            "look_back_period_s": SCALING_LOOK_BACK_S,
            "policy": {"policy_function": SCALED_POOL_POLICY, "policy_kwargs": policy_kwargs},
        },
        request_router_config={"request_router_class": SCALED_POOL_REQUEST_ROUTER},
        graceful_shutdown_timeout_s=scaling.drain_timeout_s + ENGINE_STOP_S,
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        health_check_period_s=ENGINE_HEALTH_CHECK_PERIOD_S,
        ray_actor_options=actor_options,
    )
    return engines.bind(engine_spec(config, pool_name(pool), pool, 0))


def _kv_transfer_config(config: AppConfig, pool: PoolConfig) -> dict[str, Any] | None:
    """PD's pools produce or consume KV; auto's engines do both, per request."""
    roles: dict[str, KVRole] = {
        "prefill": "kv_producer",
        "decode": "kv_consumer",
        "mixed": "kv_both",
    }
    if config.shape not in KV_SHAPES:
        return None
    return make_kv_backend(config.kv_transfer).engine_config(roles[pool.role])


@dataclass
class _RouterProcess:
    """What the router's own process hosts across every model: engines' specs need
    their share of its CPUs and devices."""

    engines: int = 0
    devices: int = 0
    gpu: bool = False


def build_app_from_config(config: AppConfig) -> Application:
    return build_application(ApplicationConfig(models=[config], auth=config.auth))


def build_application(application: ApplicationConfig) -> Application:
    """One router for every model, and each model's engines: in their own replicas, or
    (``hosts_engines_in_router``) in the router's process."""
    hosted = _RouterProcess()
    bindings = [_bind_model(application, model, hosted) for model in application.models]
    first = application.models[0]
    resources = first.resources
    if hosted.engines:
        num_cpus = resources.router_num_cpus + hosted.engines * resources.engine_num_cpus
        actor_options = engine_actor_options(num_cpus, hosted.devices, hosted.gpu)
        health = {"health_check_period_s": ENGINE_HEALTH_CHECK_PERIOD_S}
    else:
        actor_options = {
            "num_cpus": resources.router_num_cpus,
            "runtime_env": {"env_vars": SERVE_REPLICA_ENV},
        }
        health = {}
    place(actor_options, first.router.placement)
    router = deployment_by_path(
        ROUTER_CLASS,
        "Router",
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options=actor_options,
        **health,
    )
    return router.bind(bindings)


def _bind_model(
    application: ApplicationConfig, config: AppConfig, hosted: _RouterProcess
) -> ModelBinding:
    suffix = application.engine_prefix(config)
    settings = config.ingress_settings(serve_http_host())
    roles: dict[str, str] = {}
    if config.hosts_engines_in_router:
        # Each engine keeps the replica name it would have had; device offsets count
        # across every engine the router's process holds.
        specs: dict[str, EngineSpec] = {}
        names = engine_names(config, suffix)
        shared = len(names) > 1 or application.several
        for name, pool, index in names:
            offset = hosted.devices if shared else None
            specs[name] = engine_spec(config, name, pool, index, offset)
            roles[name] = pool.role
            hosted.devices += pool.ranks_per_replica
            hosted.engines += 1
        hosted.gpu = hosted.gpu or config.accelerator == "gpu"
        return ModelBinding(settings=settings, roles=roles, local_engines=specs)
    engines: dict[str, Application] = {}
    for deployment, members in engine_groups(config, suffix):
        if len(members) == 1 and members[0][1].engines_per_process == 1:
            name, pool, index = members[0]
            bound = build_engine(config, name, pool, index)
        else:
            bound = build_engine_group(config, deployment, members)
        for name, pool, _ in members:
            engines[name] = bound  # one deployment, one handle, for the group's engines
            roles[name] = pool.role
    scaled = scaled_pool_settings(config, suffix)
    pools = {item.deployment: build_scaled_pool(config, item) for item in scaled}
    settings = settings.model_copy(update={"scaled_pools": scaled})
    return ModelBinding(settings=settings, roles=roles, engines=engines, pool_handles=pools)


def serve_http_host() -> str | None:
    """Where Serve's HTTP servers listen (the YAML's ``http_options.host``; direct
    ingress binds the same), asked of the running Serve controller; None without one.
    Serve has no public call for it: this reads its client (Ray 2.60), and says nothing
    rather than fail where that changes."""
    if not ray.is_initialized():
        return None
    try:
        from ray.serve.context import _get_global_client

        client = _get_global_client(raise_if_no_controller_running=False)
        return None if client is None else str(client.http_config.host)
    except Exception:  # only a start-up warning depends on it
        logger.debug("Serve's HTTP host is unknown", exc_info=True)
        return None


def build_app(args: dict[str, Any]) -> Application:
    """Serve application builder: ``import_path: deployments.app:build_app``."""
    check_top_level_packages()
    return build_application(parse_application(args))
