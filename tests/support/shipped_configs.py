"""The shipped YAMLs' application args, as they are and as their comments say to run
them on GPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"
# What the advisor writes beside them (`advise` answers as a YAML; git ignores them).
ADVISED = "advised-"
# Every application YAML shipped in deployments/, by name.
SHIPPED = sorted(
    path.stem for path in DEPLOYMENTS.glob("*.yaml") if not path.name.startswith(ADVISED)
)


def shipped_args(name: str) -> dict[str, Any]:
    """``deployments/<name>.yaml``'s application args, a fresh copy per call."""
    document = yaml.safe_load((DEPLOYMENTS / f"{name}.yaml").read_text())
    return document["applications"][0]["args"]


def served_models(args: dict[str, Any]) -> list[dict[str, Any]]:
    """Each served model's args: the entries of ``models:``, else the args themselves."""
    if "models" not in args:
        return [args]
    shared = {key: value for key, value in args.items() if key != "models"}
    return [{**shared, **entry} for entry in args["models"]]


def on_gpus(name: str) -> dict[str, Any]:
    """The same args with ``accelerator: gpu`` and without the CPU-only pool fields."""
    args = shipped_args(name)
    for model in args.get("models", [args]):
        for pool in model["pools"]:
            pool.pop("cpu_binds", None)
            pool.pop("kv_cache_gib", None)
    return {**args, "accelerator": "gpu"}
