"""Each engine's vLLM arguments: every shipped YAML, run on GPUs as its comment says,
starts engines with ``vllm serve``'s own defaults, except where the shape or a choice
written in the YAML says otherwise; on CPUs the embedded model keeps float32 and eager."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from deployments.app import engine_spec
from deployments.config import parse_application
from engines.host import build_engine_args
from tests.support.shipped_configs import SHIPPED, on_gpus, served_models, shipped_args

MODEL = "meta-llama/Llama-3.2-1B-Instruct"
# What an engine sets apart from `vllm serve MODEL`, and why; nothing else may differ.
SET_BY_THE_SHAPE = {
    "served_model_name": "the name clients use, from model.served_model_name",
    "tensor_parallel_size": "the pool's shape",
    "pipeline_parallel_size": "the pool's shape",
    "distributed_executor_backend": "multiprocessing for TP/PP ranks inside one replica",
    "kv_transfer_config": "PD's and auto's KV connector",
    "kv_events_config": "the router's prefix index reads the engine's KV events",
    "logits_processors": "a handed-over request continues from the prefill engine's first"
    " token (engines/continuation.py)",
    "enable_lora": "models with lora_adapters, as vllm serve --enable-lora",
    "max_loras": "as many adapters as model.lora_adapters names (vllm serve --max-loras)",
    "enable_prefix_caching": "on, as vLLM's own default resolves it for these models; the"
    " router's prefix index needs it on, so it is not left to vLLM's choice",
}


def _vllm_serve_defaults() -> dict[str, Any]:
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", MODEL])
    return dataclasses.asdict(AsyncEngineArgs.from_cli_args(parsed))


def _engine_args(args: dict[str, Any]) -> list[dict[str, Any]]:
    """Every engine's vLLM arguments, of each model the args serve."""
    engines = []
    for config in parse_application(args).models:
        specs = [engine_spec(config, f"{p.role}-0", p, 0) for p in config.pools]
        engines += [dataclasses.asdict(build_engine_args(spec)) for spec in specs]
    return engines


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_yamls_on_gpus_start_engines_as_vllm_serve_would(name: str) -> None:
    args = on_gpus(name)
    for model in args.get("models", [args]):
        model["model"] = {**model["model"], "source": MODEL, "served_model_name": None}
    if "models" in args:  # two names for one checkpoint, as vllm serve would serve them
        for index, model in enumerate(args["models"]):
            model["model"]["served_model_name"] = f"{MODEL}-{index}"
    serve = _vllm_serve_defaults()
    # Defaults the CLI and the dataclass spell differently (None against False, ...):
    # an engine made from the dataclass may match either.
    dataclass_defaults = dataclasses.asdict(AsyncEngineArgs(model=MODEL))
    pools = [pool for model in served_models(args) for pool in model["pools"]]
    for pool, engine in zip(pools, _engine_args(args), strict=True):
        chosen = set(pool.get("engine_kwargs", {}))  # written in the YAML, on purpose
        different = {
            field: (engine[field], serve[field])
            for field in serve
            if field not in SET_BY_THE_SHAPE
            and field not in chosen
            and engine[field] not in (serve[field], dataclass_defaults[field])
        }
        assert different == {}, f"{name}.yaml on GPUs: (ours, vllm serve's) {different}"
        assert engine["dtype"] == "auto" and engine["enforce_eager"] is False
        assert engine["max_model_len"] is None


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_yamls_on_cpus_run_the_embedded_model_in_float32_eager(name: str) -> None:
    for engine in _engine_args(shipped_args(name)):
        assert engine["dtype"] == "float32" and engine["enforce_eager"] is True


def test_what_the_yaml_sets_wins_over_the_accelerators_defaults() -> None:
    args = on_gpus("single")
    args["model"] = {
        "source": MODEL,
        "dtype": "bfloat16",
        "enforce_eager": True,
        "max_model_len": 8192,
    }
    args["pools"][0]["gpu_memory_utilization"] = 0.5
    (engine,) = _engine_args(args)
    assert (engine["dtype"], engine["enforce_eager"], engine["max_model_len"]) == (
        "bfloat16",
        True,
        8192,
    )
    assert engine["gpu_memory_utilization"] == 0.5


def test_kv_offloading_reaches_vllm_which_makes_its_offloading_connector() -> None:
    """The pool's offloading fields become vllm serve's flags, and vLLM's own config turns
    them into its offloading connector with that many bytes of host memory."""
    from vllm.config import CacheConfig, VllmConfig

    args = on_gpus("dp")
    args["model"] = {"source": MODEL}
    for pool in args["pools"]:
        pool["kv_offloading_size"] = 2.5
    engines = _engine_args(args)
    assert [(e["kv_offloading_size"], e["kv_offloading_backend"]) for e in engines] == [
        (2.5, "native")
    ] * len(engines)
    assert all(e["kv_transfer_config"] is None for e in engines)

    # vLLM's translation, run on just the two configs it reads and writes.
    configs = SimpleNamespace(
        cache_config=CacheConfig(kv_offloading_size=2.5), kv_transfer_config=None
    )
    VllmConfig._post_init_kv_transfer_config(configs)  # type: ignore[arg-type]
    transfer = configs.kv_transfer_config
    assert transfer.kv_connector in ("OffloadingConnector", "SimpleCPUOffloadConnector")
    assert transfer.kv_connector_extra_config["cpu_bytes_to_use"] == 2.5 * 2**30
