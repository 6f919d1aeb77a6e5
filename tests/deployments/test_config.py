"""Serve YAML args are validated with messages that name the field and what is allowed."""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployments.app import engine_names, engine_process_env, engine_spec
from deployments.config import (
    ConfigError,
    load_app_config,
    load_application,
    parse_app_config,
    parse_application,
    refuse_engine_overrides,
)
from router.policies.prefill_policies import CostSettings
from tests.support.shipped_configs import on_gpus, shipped_args

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"


@pytest.mark.parametrize(
    "name", ["single", "dp", "tp", "pp", "pd", "pd_always", "auto", "auto_scaled"]
)
def test_shipped_configs_are_valid(name: str) -> None:
    config = load_app_config(DEPLOYMENTS / f"{name}.yaml")
    assert config.shape == name.split("_")[0]
    # What the router is handed is the validated objects themselves, not a dump.
    settings = config.ingress_settings()
    assert settings.router is config.router and settings.qos is config.qos
    assert settings.disaggregated == (config.shape == "pd")


def test_auto_engines_hand_kv_both_ways_and_weigh_the_cost_by_default() -> None:

    config = parse_app_config({"shape": "auto", "pools": [{"replicas": 2}]})
    assert config.prefill_policy.name == "cost"
    assert config.ingress_settings().kv_transfer is not None
    for name, pool, index in engine_names(config):
        spec = engine_spec(config, name, pool, index)
        assert spec.kv_transfer is not None and spec.kv_transfer["kv_role"] == "kv_both"
    chosen = parse_app_config(
        {"shape": "auto", "pools": [{"replicas": 2}], "prefill_policy": {"name": "always"}}
    )
    assert chosen.prefill_policy.name == "always"
    tuned = parse_app_config(
        {"shape": "auto", "pools": [{"replicas": 2}], "prefill_policy": {"max_transfer_s": 1}}
    )
    assert tuned.prefill_policy.flat()["max_transfer_s"] == 1


def test_dp_names_one_deployment_per_replica_with_its_own_core() -> None:
    config = load_app_config(DEPLOYMENTS / "dp.yaml")
    names = [name for name, _, _ in engine_names(config)]
    assert names == ["engine-0", "engine-1"]
    binds = [
        engine_process_env(config, config.pools[0], i)["VLLM_CPU_OMP_THREADS_BIND"] for i in (0, 1)
    ]
    assert binds == ["0", "1"]


def test_eager_cpu_engines_compile_nothing_and_compiling_ones_keep_torch_compile() -> None:
    eager = load_app_config(DEPLOYMENTS / "single.yaml")
    assert engine_process_env(eager, eager.pools[0], 0)["TORCHDYNAMO_DISABLE"] == "1"
    args = shipped_args("single")
    compiled = parse_app_config({**args, "model": {**args["model"], "enforce_eager": False}})
    assert "TORCHDYNAMO_DISABLE" not in engine_process_env(compiled, compiled.pools[0], 0)


def test_dp_holds_engines_of_any_tensor_parallel_degree() -> None:
    # DP of TP-4 engines: what a model too large for one GPU serves as (the advisor
    # writes it); each engine's ranks are its devices.
    config = parse_app_config(
        {
            "shape": "dp",
            "accelerator": "gpu",
            "pools": [{"replicas": 2, "tensor_parallel_size": 4}],
        }
    )
    assert config.pools[0].ranks_per_replica == 4 and config.engine_replicas == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"shape": "dq", "pools": [{}]}, "shape: Input should be 'single', 'dp'"),
        ({"shape": "dp", "pools": [{"replicas": 1}]}, "needs replicas >= 2"),
        (
            {"shape": "dp", "pools": [{"replicas": 2, "pipeline_parallel_size": 2}]},
            "needs pipeline_parallel_size = 1",
        ),
        ({"shape": "tp", "pools": [{"tensor_parallel_size": 1}]}, "tensor_parallel_size >= 2"),
        ({"shape": "single", "pools": [{"replicas": 2}]}, "needs replicas = 1"),
        ({"shape": "pd", "pools": [{"role": "mixed"}]}, "one 'prefill' and one 'decode'"),
        (
            {"shape": "dp", "pools": [{"replicas": 2, "cpu_binds": ["0"]}]},
            "cpu_binds has 1 entries but replicas is 2",
        ),
        (
            {"shape": "tp", "pools": [{"tensor_parallel_size": 2, "cpu_binds": ["0"]}]},
            "names 1 rank(s)",
        ),
        ({"shape": "single", "pools": [{"replica": 1}]}, "pools.0.replica: Extra inputs"),
        (
            {
                "shape": "pd",
                "pools": [
                    {"role": "prefill", "engine_kwargs": {"kv_cache_dtype": "fp8"}},
                    {"role": "decode"},
                ],
            },
            "must share one KV layout, but (prefill != decode): engine_kwargs.kv_cache_dtype",
        ),
        (
            {"shape": "single", "pools": [{"engine_kwargs": {"max_num_seq": 8}}]},
            "pools.0.engine_kwargs: engine_kwargs: 'max_num_seq' is not one of"
            " vLLM's engine arguments (did you mean 'max_num_seqs'",
        ),
        (
            {"shape": "single", "pools": [{"engine_kwargs": {"dtype": "half"}}]},
            "'dtype' is set by model.dtype; use that",
        ),
        (
            {
                "shape": "auto",
                "pools": [
                    {"replicas": 2, "engine_kwargs": {"speculative_config": {"method": "ngram"}}}
                ],
            },
            "vLLM refuses logits processors beside speculative decoding",
        ),
        (
            {"shape": "single", "model": {"tool_call_parser": "hermez"}},
            "tool_call_parser 'hermez' is not one of vLLM's",
        ),
        (
            {"shape": "single", "model": {"enable_auto_tool_choice": True}},
            "enable_auto_tool_choice needs a tool_call_parser",
        ),
        (
            {
                "shape": "dp",
                "pools": [{"replicas": 2, "engine_kwargs": {"tensor_parallel_size": 2}}],
            },
            "'tensor_parallel_size' is set by the pool's tensor_parallel_size",
        ),
        (
            {
                "shape": "pd",
                "pools": [{"role": "prefill", "tensor_parallel_size": 2}, {"role": "decode"}],
            },
            "tensor_parallel_size 2 != 1",
        ),
        (
            {
                "shape": "pd",
                "pools": [{"role": "prefill"}, {"role": "decode"}],
                "kv_transfer": {"ttl_s": 0},
            },
            "kv_transfer.ttl_s",
        ),
        ({"shape": "single", "pools": [{}], "model": {"max_model_len": 0}}, "max_model_len"),
        (
            {"shape": "auto", "pools": [{"replicas": 1}]},
            "shape 'auto' needs replicas >= 2 (an engine to hand KV to), got 1",
        ),
        (
            {"shape": "auto", "pools": [{"replicas": 2, "pipeline_parallel_size": 2}]},
            "kv_transfer backend 'object_store' does not support pipeline parallelism",
        ),
        (
            {"shape": "auto", "pools": [{"role": "prefill"}, {"role": "decode"}]},
            "shape 'auto' needs one 'mixed' pool",
        ),
        (
            {"shape": "dp", "pools": [{"replicas": 2}], "prefill_policy": {"name": "never"}},
            "prefill_policy is for shapes 'pd' and 'auto', not 'dp'",
        ),
        (
            {
                "shape": "pd",
                "pools": [{"role": "prefill"}, {"role": "decode"}],
                "prefill_policy": {"name": "sometimes"},
            },
            "prefill_policy: unknown prefill policy 'sometimes'; registered: always, conditional,"
            " cost, never",
        ),
        (
            {
                "shape": "pd",
                "pools": [{"role": "prefill"}, {"role": "decode"}],
                "prefill_policy": {"prompt_length_threshold": 0},
            },
            "  - prefill_policy.prompt_length_threshold:"
            " Input should be greater than or equal to 1",
        ),
        (
            {
                "shape": "pd",
                "pools": [{"role": "prefill"}, {"role": "decode"}],
                "kv_transfer": {"backend": "nixl"},
            },
            "kv_transfer: unknown KV backend 'nixl'; registered: example_disk,"
            " object_store, simulated",
        ),
        (
            {
                "shape": "pd",
                "pools": [{"role": "prefill"}, {"role": "decode"}],
                "kv_transfer": {"backend": "object_store", "storage_path": "/tmp/x"},
            },
            "kv_transfer.storage_path: Extra inputs are not permitted",
        ),
        (
            {"shape": "dp", "pools": [{"replicas": 2}], "router": {"replica_choice": "random"}},
            "router.replica_choice: unknown engine choice 'random'; registered: least_loaded,"
            " prefix_affinity, round_robin",
        ),
        (
            {
                "shape": "dp",
                "pools": [{"replicas": 2}],
                "router": {"replica_choice_settings": {"prefix_affinity": {"min_hit_tokens": 0}}},
            },
            "replica_choice_settings.prefix_affinity.min_hit_tokens: Input should be greater",
        ),
        (
            {"shape": "dp", "pools": [{"replicas": 2}], "engine": {"backend": "tgi"}},
            "engine.backend: unknown engine backend 'tgi'; registered: simulated, synthetic, vllm",
        ),
        (
            {
                "shape": "dp",
                "pools": [{"replicas": 2}],
                "router": {"replica_choice": {"decode": "least_loaded"}},
            },
            "names roles ['decode'] this shape has no pool for",
        ),
        (
            {"shape": "dp", "pools": [{"replicas": 2}], "router": {"replica_choice": "random"}},
            "router.replica_choice",
        ),
        (
            {"shape": "single", "pools": [{}], "qos": {"queue_caps": {"high": 5}}},
            "queue_caps needs a cap for every priority; missing ['normal', 'low']",
        ),
        (
            {"shape": "single", "pools": [{}], "qos": {"early_rejection_s": {"low": 3.0}}},
            "early_rejection_s must be above 0 and at most ttft_slo_s (2 s); got {'low': 3.0}",
        ),
        (
            {"shape": "single", "pools": [{}], "qos": {"ttft_slo_s": 0}},
            "qos.ttft_slo_s: Input should be greater than 0",
        ),
        (
            {
                "shape": "pd",
                "pools": [{"role": "prefill"}, {"role": "decode"}],
                "engine": {"backend": "synthetic"},
            },
            "engine.backend 'synthetic' serves shapes single and dp, not 'pd'",
        ),
        (
            {"shape": "single", "pools": [{}], "engine": {"backend": "fake"}},
            "engine.backend: unknown engine backend 'fake'; registered: simulated, synthetic, vllm",
        ),
        (
            {
                "shape": "dp",
                "pools": [{"replicas": 2, "autoscaling": {"min_replicas": 3, "max_replicas": 2}}],
            },
            "min_replicas (3) is above max_replicas (2)",
        ),
        (
            {
                "shape": "dp",
                "pools": [{"replicas": 4, "autoscaling": {"max_replicas": 3}}],
            },
            "replicas (4), the count a scaled pool starts with, must be within",
        ),
        (
            {
                "shape": "dp",
                "pools": [
                    {
                        "replicas": 2,
                        "autoscaling": {
                            "max_replicas": 3,
                            "scale_up_at": 0.5,
                            "scale_down_at": 0.5,
                        },
                    }
                ],
            },
            "scale_down_at (0.5) must be below scale_up_at (0.5)",
        ),
        (
            {
                "shape": "dp",
                "pools": [
                    {"replicas": 2, "cpu_binds": ["0", "1"], "autoscaling": {"max_replicas": 3}}
                ],
            },
            "cpu_binds has 2 entries but autoscaling.max_replicas is 3",
        ),
        (
            {"shape": "single", "pools": [{"autoscaling": {"max_replicas": 2}}]},
            "shape 'single' serves one engine; pools grow and shrink",
        ),
        (
            {
                "shape": "dp",
                "pools": [{"replicas": 2, "autoscaling": {"max_replicas": 3}}],
                "router": {"engine_in_router": True},
            },
            "pools with autoscaling run as engine replicas of their own",
        ),
        (
            {
                "shape": "dp",
                "pools": [
                    {"replicas": 2, "engines_per_process": 2, "autoscaling": {"max_replicas": 3}}
                ],
            },
            "engines_per_process > 1 groups a pool of fixed size",
        ),
        (
            {
                "shape": "dp",
                "pools": [{"replicas": 4, "engines_per_process": 2}],
                "router": {"engine_in_router": True},
            },
            "pools with engines_per_process > 1 run in engine processes of their own",
        ),
        # Renamed keys name their new name, not just "extra inputs".
        (
            {
                "shape": "pd",
                "pools": [{"role": "prefill"}, {"role": "decode"}],
                "split_policy": {"name": "always"},
            },
            "renamed: 'split_policy' is now 'prefill_policy'",
        ),
        (
            {
                "shape": "pd",
                "pools": [{"role": "prefill"}, {"role": "decode"}],
                "prefill_policy": {"mode": "always"},
            },
            "prefill_policy: renamed: 'mode' is now 'name'",
        ),
    ],
)
def test_bad_config_names_the_field(args: dict, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_app_config(args)
    assert message in str(raised.value)


def test_pd_always_is_pd_without_the_policies() -> None:
    conditional = load_app_config(DEPLOYMENTS / "pd.yaml")
    always = load_app_config(DEPLOYMENTS / "pd_always.yaml")
    assert (always.prefill_policy.name, always.qos.enabled) == ("always", False)
    assert conditional.prefill_policy.name == "conditional" and conditional.qos.enabled
    policies = {"router", "prefill_policy", "qos", "pools"}
    assert always.model_dump(exclude=policies) == conditional.model_dump(exclude=policies)
    for ours, theirs in zip(always.pools, conditional.pools, strict=True):
        # Priority scheduling only orders requests; the engines are otherwise the same.
        assert ours.model_dump(exclude={"engine_kwargs"}) == theirs.model_dump(
            exclude={"engine_kwargs"}
        )


@pytest.mark.parametrize(
    ("name", "setting", "in_router"),
    [
        ("single", "auto", True),
        ("tp", "auto", True),
        ("pp", "auto", True),
        ("dp", "auto", True),
        ("pd", "auto", True),
        ("dp", False, False),
        ("pd", False, False),
        ("single", False, False),
        ("dp", True, True),
    ],
)
def test_the_router_hosts_engines_unless_told_not_to(
    name: str, setting: str | bool, in_router: bool
) -> None:
    args = shipped_args(name)
    args.setdefault("router", {})["engine_in_router"] = setting
    assert parse_app_config(args).hosts_engines_in_router is in_router


@pytest.mark.parametrize("name", ["single", "tp", "pp", "dp", "pd", "pd_always", "auto"])
def test_auto_gives_gpu_engines_a_front_end_each(name: str) -> None:
    # One GIL for the GPU engines' tokens is what issue 22 set out to remove; CPU engines
    # keep the path measured to win where their compute needs every core.
    assert not parse_app_config(on_gpus(name)).hosts_engines_in_router
    assert parse_app_config(shipped_args(name)).hosts_engines_in_router


@pytest.mark.parametrize("override", [{"num_replicas": 2}, {"autoscaling_config": {}}])
def test_serve_overrides_of_an_engine_deployment_are_refused(
    tmp_path: Path, override: dict
) -> None:
    document = yaml.safe_load((DEPLOYMENTS / "dp.yaml").read_text())
    document["applications"][0]["deployments"] = [
        {"name": "Router", "num_replicas": 2},  # routers may be scaled
        {"name": "engine-0", **override},
    ]
    path = tmp_path / "dp-scaled-engine.yaml"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(ConfigError) as raised:
        refuse_engine_overrides(path)
    assert "deployments[engine-0]" in str(raised.value)
    assert "args.pools[].replicas" in str(raised.value)
    for name in ("single", "dp", "pd"):
        refuse_engine_overrides(DEPLOYMENTS / f"{name}.yaml")  # the shipped ones pass


def _pd_args(**router: object) -> dict:
    placed = {"node_labels": {"splitserve-pool": "prefill"}}
    return {
        "shape": "pd",
        "pools": [
            {"role": "prefill", "placement": placed},
            {"role": "decode", "placement": {"resources": {"decode_node": 1}}},
        ],
        "router": router,
    }


def test_placed_pools_run_as_engine_replicas_on_their_nodes() -> None:
    from deployments.app import build_app_from_config

    config = parse_app_config(_pd_args())
    assert config.placed and not config.hosts_engines_in_router  # auto: apart
    app = build_app_from_config(config)
    options = {
        name: deployment.ray_actor_options
        for name, deployment in _bound_deployments(app).items()
        if name != "Router"
    }
    assert options["prefill-0"]["label_selector"] == {"splitserve-pool": "prefill"}
    assert options["decode-0"]["resources"] == {"decode_node": 1.0}
    assert "label_selector" not in _bound_deployments(app)["Router"].ray_actor_options


def test_the_router_is_placed_where_the_yaml_says() -> None:
    from deployments.app import build_app_from_config

    beside_decode = {"node_labels": {"splitserve-pool": "decode"}}
    app = build_app_from_config(parse_app_config(_pd_args(placement=beside_decode)))
    router_options = _bound_deployments(app)["Router"].ray_actor_options
    assert router_options["label_selector"] == {"splitserve-pool": "decode"}
    with pytest.raises(ValueError, match="placement needs node_labels"):
        parse_app_config(_pd_args(placement={}))


def _bound_deployments(app: object) -> dict[str, Any]:
    """Every deployment of a built application graph, by name."""
    found: dict[str, Any] = {}
    stack = [app._bound_deployment]  # type: ignore[attr-defined]
    while stack:
        deployment = stack.pop()
        found[deployment.name] = deployment
        values = [*deployment.init_args, *deployment.init_kwargs.values()]
        for value in values:
            if isinstance(value, list):  # the router's model bindings
                values += [{**b.engines, **b.pool_handles} for b in value]
                continue
            children = value.values() if isinstance(value, dict) else [value]
            stack += [c._bound_deployment for c in children if hasattr(c, "_bound_deployment")]
    return found


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"router": {"engine_in_router": True}}, "set router.engine_in_router to auto or false"),
        ({"placement": {}}, "placement needs node_labels, resources or both"),
        ({"placement": {"resources": {"GPU": 1}}}, "names Ray's own ['GPU']"),
        ({"placement": {"resources": {"fast": 0}}}, "must be positive amounts"),
    ],
)
def test_bad_placement_is_refused(change: dict, message: str) -> None:
    args = _pd_args()
    if "router" in change:
        args["router"] = change["router"]
    else:
        args["pools"][0]["placement"] = change["placement"]
    with pytest.raises(ConfigError) as raised:
        parse_app_config(args)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("prefill_pp", "decode_pp", "message"),
    [
        # Both pools alike, as one KV layout requires: refused for what it is.
        (2, 2, "kv_transfer backend 'object_store' does not support pipeline parallelism"),
        # One pool alone: refused as a layout mismatch that names the pipeline size.
        (2, 1, "must share one KV layout, but (prefill != decode): pipeline_parallel_size 2 != 1"),
        (1, 2, "must share one KV layout, but (prefill != decode): pipeline_parallel_size 1 != 2"),
    ],
)
def test_pd_refuses_pipeline_parallelism(prefill_pp: int, decode_pp: int, message: str) -> None:
    """README: the KV connector does not support pipeline parallelism; the config says so
    before any engine starts (the connector itself would only fail inside vLLM)."""
    args: dict[str, Any] = {
        "shape": "pd",
        "pools": [
            {"role": "prefill", "pipeline_parallel_size": prefill_pp},
            {"role": "decode", "pipeline_parallel_size": decode_pp},
        ],
    }
    with pytest.raises(ConfigError) as raised:
        parse_app_config(args)
    assert message in str(raised.value)
    # With tensor parallelism beside it, the same.
    for pool in args["pools"]:
        pool["tensor_parallel_size"] = 2
    with pytest.raises(ConfigError, match="pipeline"):
        parse_app_config(args)


def test_a_scaled_pool_runs_apart_and_may_start_below_dps_two_engines() -> None:
    config = parse_app_config(
        {"shape": "dp", "pools": [{"replicas": 1, "autoscaling": {"max_replicas": 4}}]}
    )
    assert config.scaled and not config.hosts_engines_in_router
    assert engine_names(config) == []  # Serve names its engines, by replica id
    with pytest.raises(ConfigError, match="needs replicas >= 2"):
        parse_app_config(
            {"shape": "dp", "pools": [{"replicas": 1, "autoscaling": {"max_replicas": 1}}]}
        )


def test_a_scaled_pools_engine_takes_its_name_and_its_ranks_cores() -> None:
    config = parse_app_config(
        {
            "shape": "dp",
            "pools": [{"replicas": 1, "cpu_binds": ["0", "1"], "autoscaling": {"max_replicas": 2}}],
        }
    )
    spec = engine_spec(config, "engine", config.pools[0], 0)
    member = spec.as_member("engine-abc", local_rank=1)
    assert member.name == "engine-abc"
    assert member.process_env["SPLITSERVE_ENGINE"] == "engine-abc"
    assert member.process_env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert member.process_env["VLLM_CPU_KVCACHE_SPACE"] == "1"


# ---- several models in one application ---------------------------------------------------


def _two_models(**second: Any) -> dict[str, Any]:
    one = {"shape": "single", "pools": [{}]}
    return {"models": [one, {"shape": "dp", "pools": [{"replicas": 2}], **second}]}


def test_a_yaml_without_models_serves_its_args_as_one_model() -> None:
    application = parse_application(shipped_args("pd"))
    (model,) = application.models
    assert model.shape == "pd" and model.served_name == "splitserve-tiny-llama"
    assert application.engine_prefix(model) == ""


def test_models_yaml_serves_two_models_each_with_its_own_split() -> None:
    application = load_application(DEPLOYMENTS / "models.yaml")
    chat, split = application.models
    assert (chat.served_name, chat.shape) == ("tiny-chat", "single")
    assert (split.served_name, split.shape) == ("tiny-code", "pd")
    assert split.model.source == "embedded:1" and chat.accelerator == split.accelerator == "cpu"
    assert split.ingress_settings().disaggregated and not chat.ingress_settings().disaggregated
    assert application.engine_prefix(split) == "-tiny-code"


def test_an_embedded_variant_is_another_model_with_its_own_name() -> None:
    application = parse_application(_two_models(model={"source": "embedded:3"}))
    assert [m.served_name for m in application.models] == [
        "splitserve-tiny-llama",
        "splitserve-tiny-llama-3",
    ]
    with pytest.raises(ConfigError, match="embedded:<seed>"):
        parse_application(_two_models(model={"source": "embedded:x"}))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (_two_models(), "served twice; set model.served_model_name"),
        (
            {**_two_models(model={"source": "embedded:1"}), "shape": "dp"},
            "belong inside each model's entry",
        ),
        (
            _two_models(model={"source": "embedded:1"}, auth={"keys": []}),
            "API keys guard the whole application",
        ),
        (
            _two_models(model={"source": "embedded:1"}, router={"max_request_bytes": 1000}),
            "router.max_request_bytes is the router process's own",
        ),
    ],
)
def test_several_models_are_refused_where_they_would_clash(
    args: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_application(args)


def test_several_models_engines_are_named_after_their_model() -> None:
    from deployments.app import build_application

    application = load_application(DEPLOYMENTS / "models.yaml")
    bindings = build_application(application)._bound_deployment.init_args[0]
    assert [sorted(b.local_engines) for b in bindings] == [
        ["engine-tiny-chat-0"],
        ["decode-tiny-code-0", "prefill-tiny-code-0"],
    ]


def test_simulated_engines_time_scale_stretches_the_routers_objectives() -> None:
    """The YAML's SLOs and hand-over budget are in the engines' own time; the router
    measures wall-clock times of engines time_scale times slower."""
    args = shipped_args("auto")
    plain = parse_app_config(copy.deepcopy(args)).ingress_settings()
    args["engine"] = {"backend": "simulated", "profile": "h100-llama-3.1-8b", "time_scale": 20}
    args.pop("kv_transfer")  # simulated engines hand over simulated KV
    stretched = parse_app_config(args).ingress_settings()
    assert stretched.qos.ttft_slo_s == 20 * plain.qos.ttft_slo_s
    assert stretched.qos.early_rejection_s == {
        priority: 20 * seconds for priority, seconds in plain.qos.early_rejection_s.items()
    }
    assert stretched.qos.retry_after_s == plain.qos.retry_after_s  # the client's clock
    plain_split, split = plain.prefill_policy.settings, stretched.prefill_policy.settings
    assert isinstance(plain_split, CostSettings) and isinstance(split, CostSettings)
    assert split.max_transfer_s == 20 * plain_split.max_transfer_s
    assert split.min_ttft_gain == plain_split.min_ttft_gain  # a ratio
    assert split.prompt_length_threshold == plain_split.prompt_length_threshold


@pytest.mark.parametrize(
    ("pool", "app", "message"),
    [
        (
            {},
            {},
            "the mixed pool's kv_offloading_size: vLLM cannot offload a CPU engine's KV"
            " (it refuses at start-up: 'CPU Offloading is currently only supported on"
            " CUDA-alike and XPU GPUs')",
        ),
        (
            {"kv_offloading_backend": "lmcache"},
            {},
            "kv_offloading_backend 'lmcache' needs the lmcache package",
        ),
        (
            {},
            {"engine": {"backend": "synthetic"}},
            "engine.backend 'synthetic' does not model it",
        ),
    ],
)
def test_kv_offloading_is_refused_where_vllm_cannot_offload(
    pool: dict[str, Any], app: dict[str, Any], message: str
) -> None:
    if pool and importlib.util.find_spec("lmcache") is not None:
        pytest.skip("lmcache is installed here")
    args = {**shipped_args("dp"), **app}
    args["pools"][0].update(kv_offloading_size=4, **pool)
    with pytest.raises(ConfigError) as raised:
        parse_app_config(args)
    assert message in str(raised.value)


@pytest.mark.parametrize("shape", ["pd", "auto"])
def test_kv_offloading_beside_the_kv_hand_over_is_refused(shape: str) -> None:
    """vLLM would replace the hand-over's connector with its offloading connector."""
    args = on_gpus(shape)
    args["pools"][0]["kv_offloading_size"] = 4
    with pytest.raises(ConfigError, match="vLLM's offloading would replace it"):
        parse_app_config(args)


def test_kv_offloading_is_a_pool_field_not_an_engine_kwarg() -> None:
    args = on_gpus("dp")
    args["pools"][0]["engine_kwargs"] = {"kv_offloading_size": 4}
    with pytest.raises(ConfigError, match="the pool's kv_offloading_size"):
        parse_app_config(args)
