"""Shipped YAMLs served together: each one's args as a model of one application
(``models:``), so that the served tests of many shapes share one start.

Starting an application with vLLM engines costs about a minute on this box, most of it
each engine's two processes importing torch and vLLM, and its stop ten seconds more;
one start for seven shapes takes about as long as two. Each model keeps its YAML's
pools, policies, QoS and KV backend; what differs is its served name, which requests
name it by (the YAML's own name for the first, ``single``, which also answers requests
that name no model), its engines' names (each ends in its model's:
``engine-dp-tiny-0``), and a KV cache sized for tests (``TEST_KV_BLOCKS``). A test
reads its own model's metrics by the ``model`` label.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from deployments.config import deployment_slug
from deployments.launcher import ROUTER_DEPLOYMENT
from engines.step_log import step_log_path
from engines.tiny_model import EMBEDDED_MODEL_NAME

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"
# vLLM's CPU blocks hold 128 tokens: 64k tokens of KV per engine, 128 MB of the tiny
# model's, where the shipped 1 GiB each would hold sixteen such applications' worth.
TEST_KV_BLOCKS = 512
STEP_LOGS = "steps"  # the folder of an application's step logs, beside its YAML


@dataclass(frozen=True)
class SharedModel:
    """One model of a shared application: the shipped YAML whose args it serves with,
    under ``name``, with ``overrides``: each replaces the YAML's block of that name,
    except ``router`` and ``model``, whose keys it replaces."""

    name: str
    shipped: str
    overrides: dict[str, Any] = field(default_factory=dict)
    # Of a YAML that serves several models (models.yaml): the one served under this name.
    entry: str | None = None
    # Its vLLM engines log each step (engine.step_log) under the application's folder.
    step_log: bool = False

    def engine(self, role: str, index: int) -> str:
        """The name of its ``index``-th engine of ``role``'s pool (``engine`` for mixed)."""
        prefix = "engine" if role == "mixed" else role
        return f"{prefix}-{deployment_slug(self.name)}-{index}"

    @property
    def group_prefix(self) -> str:
        """What its engine groups' Serve deployments are named from (engine-group-...)."""
        return f"engine-{deployment_slug(self.name)}-group-"


# The shapes whose tests need only their own model (tests/deployments, the hostile and
# agreement tests): one engine first, as the reference every split is held to.
SHAPES: dict[str, SharedModel] = {
    "single": SharedModel(EMBEDDED_MODEL_NAME, "single", step_log=True),
    "dp": SharedModel("dp-tiny", "dp"),
    # dp.yaml with each engine a Serve replica of its own, over the engine transport.
    "dp_apart": SharedModel("dp-apart-tiny", "dp", {"router": {"engine_in_router": False}}),
    "tp": SharedModel("tp-tiny", "tp"),
    "pp": SharedModel("pp-tiny", "pp"),
    "pd_always": SharedModel("pd-always-tiny", "pd_always"),
    # auto.yaml that always prefills on the peer: every hand-over path is taken.
    "auto": SharedModel("auto-tiny", "auto", {"prefill_policy": {"name": "always"}}),
    # models.yaml's split model, with its LoRA adapters (its other model, tiny-chat, is
    # single.yaml's under another name: single's model stands for it).
    "code": SharedModel("tiny-code", "models", entry="tiny-code"),
}


# The model-free applications' engines: tokens as fast as steps allow, or paced.
SYNTHETIC = {"backend": "synthetic"}
PACED = {"backend": "synthetic", "step_interval_s": 0.01}
SIMULATED_PROFILE = "h100-llama-3.1-8b"
SIMULATED = {"backend": "simulated", "profile": SIMULATED_PROFILE, "time_scale": 1.0}
# Two requests at a time at 10 ms a token: a queue, and a first token later than an
# SLO of a second, from a handful of clients (the scaled pools' tests).
QUEUEING = {**PACED, "max_num_seqs": 2}
# A pool Serve grows from one engine to two: a second's wait for a first token is over
# the line, tokens every 10 ms are not (tests/engines/test_scaled_pool_served.py).
SCALED_TO_TWO = {
    "min_replicas": 1,
    "max_replicas": 2,
    "ttft_slo_s": 1.0,
    "tpot_slo_s": 1.0,
    "upscale_delay_s": 0,
    "downscale_delay_s": 4,
    "window_s": 2,
    "drain_timeout_s": 90,
}
# A pool that follows a ramp of clients from one engine to four and back
# (tests/engines/test_pool_ramp_served.py).
RAMP_ENGINES = 4
SCALED_TO_FOUR = {
    **SCALED_TO_TWO,
    "max_replicas": RAMP_ENGINES,
    "downscale_delay_s": 3,
    "drain_timeout_s": 30,
}
TRAFFIC_RECORD = "traffic.jsonl"
# The traffic record's profile: a window of four requests of 10 prompt tokens and 4
# output tokens (tests/router/observation/test_traffic_served.py).
TRAFFIC_WINDOW, TRAFFIC_PROMPT_TOKENS, TRAFFIC_OUTPUT_TOKENS = 4, 10, 4
# Routers of the model-free application: each on its own direct-ingress port.
SYNTHETIC_ROUTERS = 2


def _pool(replicas: int, **fields: Any) -> list[dict[str, Any]]:
    return [{"role": "mixed", "replicas": replicas, **fields}]


def synthetic_models(folder: Path) -> dict[str, SharedModel]:
    """dp.yaml's router on synthetic engines (no model), as each model-free served test
    needs it, by the test it is for; ``folder`` holds the traffic record."""
    apart = {"engine_in_router": False}
    profile = {
        "prompt_tokens": TRAFFIC_PROMPT_TOKENS,
        "output_tokens": TRAFFIC_OUTPUT_TOKENS,
        "window_requests": TRAFFIC_WINDOW,
    }
    recording = {"traffic_record": str(folder / TRAFFIC_RECORD), "traffic_profile": profile}
    return {
        "routers": SharedModel("synthetic-dp", "dp", {"engine": SYNTHETIC, "pools": _pool(2)}),
        "groups": SharedModel(
            "synthetic-groups",
            "dp",
            {"engine": SYNTHETIC, "router": apart, "pools": _pool(4, engines_per_process=2)},
        ),
        "recorded": SharedModel(
            "synthetic-recorded",
            "dp",
            {"engine": SYNTHETIC, "router": recording, "pools": _pool(2)},
        ),
        "scaled": SharedModel(
            "synthetic-scaled",
            "dp",
            {"engine": QUEUEING, "pools": _pool(1, autoscaling=SCALED_TO_TWO)},
        ),
        "ramp": SharedModel(
            "synthetic-ramp",
            "dp",
            {"engine": QUEUEING, "pools": _pool(1, autoscaling=SCALED_TO_FOUR)},
        ),
        # auto_scaled.yaml's pool on simulated engines keeping an H100's time for Llama
        # 3.1 8B, as deployments.serve --simulate serves it (launcher.simulated_config).
        "simulated": SharedModel(
            "simulated-auto",
            "auto_scaled",
            {"engine": SIMULATED, "kv_transfer": {"backend": "simulated"}},
        ),
        # Its tests kill engines and a router: the last of this application's users.
        "apart": SharedModel(
            "synthetic-apart", "dp", {"engine": PACED, "router": apart, "pools": _pool(2)}
        ),
    }


def synthetic_app(folder: Path) -> Path:
    """The model-free served tests' shared application, behind SYNTHETIC_ROUTERS routers."""
    return shared_app(folder, "synthetic", synthetic_models(folder), SYNTHETIC_ROUTERS)


def shared_app(folder: Path, name: str, models: dict[str, SharedModel], routers: int = 1) -> Path:
    """Write the application serving ``models`` (in order) behind ``routers`` router
    replicas to ``folder``/``name``.yaml."""
    first = _shipped(next(iter(models.values())).shipped)
    entries = [_entry(model, folder) for model in models.values()]
    shared = {key: first["args"][key] for key in ("accelerator",) if key in first["args"]}
    application = {**first["application"], "args": {**shared, "models": entries}}
    if routers > 1:
        application["deployments"] = [{"name": ROUTER_DEPLOYMENT, "num_replicas": routers}]
    document = {
        **{key: value for key, value in first["document"].items() if key != "applications"},
        "applications": [application],
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def step_log_file(folder: Path, model: SharedModel, role: str = "mixed", index: int = 0) -> Path:
    """Where the engine ``index`` of ``role`` of a ``step_log`` model of an application
    written to ``folder`` logs its steps."""
    return Path(step_log_path(str(folder / STEP_LOGS), model.engine(role, index)))


def _entry(model: SharedModel, folder: Path) -> dict[str, Any]:
    args = copy.deepcopy(_shipped(model.shipped)["args"])
    if model.entry is not None:
        (args,) = [m for m in args["models"] if m["model"]["served_model_name"] == model.entry]
    args.pop("accelerator", None)  # the application's, shared by every model
    args["model"] = {**args.get("model", {}), "served_model_name": model.name}
    merged = _merged(args, model.overrides)
    if model.step_log:
        merged["engine"] = {**merged.get("engine", {}), "step_log": str(folder / STEP_LOGS)}
    if merged.get("engine", {}).get("backend", "vllm") == "vllm":
        for pool in merged["pools"]:
            kwargs = pool.setdefault("engine_kwargs", {})
            kwargs.setdefault("num_gpu_blocks_override", TEST_KV_BLOCKS)
    return merged


# Blocks an override updates rather than replaces.
UPDATED_BLOCKS = ("router", "model")


def _merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        merged[key] = {**merged.get(key, {}), **value} if key in UPDATED_BLOCKS else value
    return merged


def _shipped(name: str) -> dict[str, Any]:
    document = yaml.safe_load((DEPLOYMENTS / f"{name}.yaml").read_text())
    (application,) = document["applications"]
    return {"document": document, "application": application, "args": application["args"]}
