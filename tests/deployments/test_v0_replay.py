"""Replaying benchmarks of vLLM 0.6.0's V0 engine: a YAML's num_scheduler_steps and
enable_chunked_prefill choose the simulated engines' scheduling, and are refused where the
installed vLLM would run them."""

from __future__ import annotations

import re
from typing import Any

import pytest

from deployments.app import engine_names, engine_spec
from deployments.config import ConfigError, parse_app_config
from engines.settings import EngineSpec
from engines.simulated.settings import engine_profile, scheduler_limits

PROFILE = "h100-llama-3.1-8b"
# LambdaLabsML/vllm-benchmark's and SGLang's vLLM 0.6.0 runs.
V0_ARGS = {"num_scheduler_steps": 10, "max_num_seqs": 256}


def _args(engine_kwargs: dict[str, Any], backend: str = "simulated") -> dict[str, Any]:
    engine = {"backend": "simulated", "profile": PROFILE} if backend == "simulated" else {}
    return {
        "shape": "single",
        "accelerator": "cpu",
        "model": {"max_model_len": 2048},
        "engine": engine,
        "pools": [{"engine_kwargs": engine_kwargs}],
    }


def _spec(engine_kwargs: dict[str, Any]) -> EngineSpec:
    config = parse_app_config(_args(engine_kwargs))
    ((name, pool, index),) = engine_names(config)
    return engine_spec(config, name, pool, index)


def test_a_v0_yaml_gives_simulated_engines_v0_scheduling_and_its_token_budget() -> None:
    spec = _spec(V0_ARGS)
    limits = scheduler_limits(spec, engine_profile(spec))
    assert (limits.chunked_prefill, limits.scheduler_steps) == (False, 10)
    assert limits.max_num_batched_tokens == 2048  # 0.6.0's max(max_model_len, 2048)
    assert limits.max_num_seqs == 256
    default = _spec({})
    limits = scheduler_limits(default, engine_profile(default))
    assert (limits.chunked_prefill, limits.scheduler_steps) == (True, 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (_args(V0_ARGS, backend="vllm"), "only engine.backend 'simulated' replays it"),
        (
            _args({**V0_ARGS, "enable_chunked_prefill": True}),
            "refuses chunked prefill with multi-step",
        ),
        (_args({"num_scheduler_steps": 0}), "at least 1"),
        (
            _args({"enable_chunked_prefill": False, "max_num_batched_tokens": 1024}),
            "below max_model_len 2048",
        ),
    ],
)
def test_what_vllm_would_not_run_is_refused(args: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_app_config(args)
