"""Serve YAML args are validated with messages that name the field and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from deployments.app import engine_env, engine_names
from deployments.config import ConfigError, load_app_config, parse_app_config

DEPLOYMENTS = Path(__file__).resolve().parent.parent / "deployments"


@pytest.mark.parametrize("name", ["single", "dp", "tp", "pp", "pd"])
def test_shipped_configs_are_valid(name: str) -> None:
    config = load_app_config(DEPLOYMENTS / f"{name}.yaml")
    assert config.strategy == name


def test_dp_names_one_deployment_per_replica_with_its_own_core() -> None:
    config = load_app_config(DEPLOYMENTS / "dp.yaml")
    names = [name for name, _ in engine_names(config)]
    assert names == ["engine-0", "engine-1"]
    binds = [engine_env(config, config.pools[0], i)["VLLM_CPU_OMP_THREADS_BIND"] for i in (0, 1)]
    assert binds == ["0", "1"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"strategy": "dq", "pools": [{}]}, "strategy: Input should be 'single', 'dp'"),
        ({"strategy": "dp", "pools": [{"replicas": 1}]}, "needs replicas >= 2"),
        ({"strategy": "tp", "pools": [{"tensor_parallel_size": 1}]}, "tensor_parallel_size >= 2"),
        ({"strategy": "single", "pools": [{"replicas": 2}]}, "needs replicas = 1"),
        ({"strategy": "pd", "pools": [{"role": "mixed"}]}, "one 'prefill' and one 'decode'"),
        (
            {"strategy": "dp", "pools": [{"replicas": 2, "cpu_binds": ["0"]}]},
            "cpu_binds has 1 entries but replicas is 2",
        ),
        (
            {"strategy": "tp", "pools": [{"tensor_parallel_size": 2, "cpu_binds": ["0"]}]},
            "names 1 rank(s)",
        ),
        ({"strategy": "single", "pools": [{"replica": 1}]}, "pools.0.replica: Extra inputs"),
        (
            {
                "strategy": "pd",
                "pools": [
                    {"role": "prefill", "engine_kwargs": {"block_size": 64}},
                    {"role": "decode"},
                ],
            },
            "must share one KV layout, but (prefill != decode): engine_kwargs.block_size 64",
        ),
        (
            {
                "strategy": "pd",
                "pools": [{"role": "prefill", "tensor_parallel_size": 2}, {"role": "decode"}],
            },
            "tensor_parallel_size 2 != 1",
        ),
        (
            {
                "strategy": "pd",
                "pools": [{"role": "prefill"}, {"role": "decode"}],
                "kv_transfer": {"ttl_s": 0},
            },
            "kv_transfer.ttl_s",
        ),
        ({"strategy": "single", "pools": [{}], "model": {"max_model_len": 0}}, "max_model_len"),
    ],
)
def test_bad_config_names_the_field(args: dict, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_app_config(args)
    assert message in str(raised.value)
