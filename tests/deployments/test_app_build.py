"""Serve's build step (``deployments.app:build_app``) runs at every start, before Serve's
proxy has the application's routes: under a plain ``serve run`` it answers 404 until the
build returns. The build names the replicas' classes by import path, so that it never
imports vLLM; these tests hold it to that and check what it hands Serve."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from deployments.app import (
    ENGINE_GROUP_CLASS,
    ENGINE_REPLICA_CLASS,
    ROUTER_CLASS,
    SCALED_POOL_POLICY,
    SCALED_POOL_REQUEST_ROUTER,
    build_app,
)
from router.settings import ModelBinding
from tests.support.shipped_configs import on_gpus, shipped_args

REPO = Path(__file__).resolve().parents[2]


def _binding(router: Any, index: int = 0) -> ModelBinding:
    """What the router is bound to for its ``index``-th model."""
    return router._bound_deployment.init_args[0][index]


HEAVY = ("vllm", "torch", "transformers", "router.http.ingress", "engines.host")


def test_the_build_step_imports_neither_vllm_nor_the_replicas() -> None:
    # A fresh interpreter: this test process has imported them for other tests.
    probe = (
        "import sys, yaml; from deployments.app import build_app;"
        " build_app(yaml.safe_load(open('deployments/pd.yaml'))['applications'][0]['args']);"
        f" print([m for m in {HEAVY!r} if m in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_replicas_are_named_by_import_paths_that_resolve() -> None:
    args = shipped_args("dp")
    args.setdefault("router", {})["engine_in_router"] = False
    router = build_app(args)
    engines = _binding(router).engines  # the router's engines, by replica name
    assert router._bound_deployment.func_or_class == ROUTER_CLASS
    assert {app._bound_deployment.func_or_class for app in engines.values()} == {
        ENGINE_REPLICA_CLASS
    }
    for path in (ROUTER_CLASS, ENGINE_REPLICA_CLASS):
        module, name = path.rsplit(".", 1)
        assert isinstance(getattr(__import__(module, fromlist=[name]), name), type)


def test_engines_per_process_puts_a_pools_engines_in_shared_deployments() -> None:
    args = shipped_args("dp")
    pool = args["pools"][0]
    pool.pop("cpu_binds", None)
    pool.update(replicas=5, engines_per_process=2)
    router = build_app(args)  # engine_in_router: auto, which a grouped pool runs apart
    engines = _binding(router).engines
    assert list(engines) == [f"engine-{index}" for index in range(5)]
    groups = {name: app._bound_deployment for name, app in engines.items()}
    assert [groups[f"engine-{index}"].name for index in range(5)] == [
        "engine-group-0",
        "engine-group-0",
        "engine-group-1",
        "engine-group-1",
        "engine-group-2",
    ]
    assert engines["engine-0"] is engines["engine-1"]  # one deployment, bound once
    first = groups["engine-0"]
    assert first.func_or_class == ENGINE_GROUP_CLASS
    assert [spec.name for spec in first.init_args[0]] == ["engine-0", "engine-1"]
    assert first.ray_actor_options["num_cpus"] == 2 * _engine_num_cpus(args)
    assert [spec.name for spec in groups["engine-4"].init_args[0]] == ["engine-4"]
    module, name = ENGINE_GROUP_CLASS.rsplit(".", 1)
    assert isinstance(getattr(__import__(module, fromlist=[name]), name), type)


def _engine_num_cpus(args: dict[str, Any]) -> float:
    return float(args.get("resources", {}).get("engine_num_cpus", 0.1))


def test_a_scaled_pool_is_one_deployment_that_serve_scales_by_our_policy() -> None:
    args = shipped_args("pd")
    decode = next(pool for pool in args["pools"] if pool["role"] == "decode")
    decode.pop("cpu_binds", None)
    decode["autoscaling"] = {"max_replicas": 3, "tpot_slo_s": 0.04, "drain_timeout_s": 30}
    router = build_app(args)
    binding = _binding(router)
    settings, roles, engines, pools = (
        binding.settings,
        binding.roles,
        binding.engines,
        binding.pool_handles,
    )
    assert set(roles) == {"prefill-0"} and set(engines) == {"prefill-0"}
    assert [s.deployment for s in settings.scaled_pools] == ["decode-pool"]
    assert settings.scaled_pools[0].drain_timeout_s == 30
    deployment = pools["decode-pool"]._bound_deployment
    assert deployment.func_or_class == ENGINE_REPLICA_CLASS
    config = deployment._deployment_config
    scaling = config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.initial_replicas) == (1, 3, 1)
    assert scaling.policy.policy_function == SCALED_POOL_POLICY
    assert scaling.policy.policy_kwargs == {
        "ttft_slo_s": 2.0,  # qos.ttft_slo_s
        "tpot_slo_s": 0.04,
        "scale_up_at": 0.8,
        "scale_down_at": 0.6,
    }
    assert config.request_router_config.request_router_class == SCALED_POOL_REQUEST_ROUTER
    assert config.graceful_shutdown_timeout_s > 30


def test_gpu_engines_each_get_a_replica_and_their_gpus() -> None:
    router = build_app(on_gpus("pd"))
    engines = _binding(router).engines
    assert set(engines) == {"prefill-0", "decode-0"}
    for engine in engines.values():
        assert engine._bound_deployment.ray_actor_options["num_gpus"] == 1
    router_options = router._bound_deployment.ray_actor_options
    assert router_options is not None and "num_gpus" not in router_options


def test_a_tensor_parallel_gpu_engine_gets_a_replica_with_all_its_gpus() -> None:
    router = build_app(on_gpus("tp"))
    (engine,) = _binding(router).engines.values()
    assert engine._bound_deployment.ray_actor_options["num_gpus"] == 2
