"""The advised deployment for where the user runs: devices, pools, accelerator, model.

The advisor picks a shape from a sweep; this sizes it (``loadgen/study/sizing.py``) for a target
rate or a device budget, raises each engine's tensor-parallel degree to what the model
needs on the target device, and writes the YAML: the shape's template from the
deployments folder, with the sized pools' ``replicas`` and degrees and, for
``--target gpu``, ``accelerator: gpu`` and the user's model in place of the CPU
settings (the embedded model, ``cpu_binds``, ``kv_cache_gib``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from loadgen.study import sizing
from loadgen.study.sizing import MeasuredSize, ModelDims, PDCapacities, Sizing

# What a CPU template holds that a GPU engine has no use for.
CPU_ONLY_POOL_KEYS = ("cpu_binds", "kv_cache_gib")
# The CPU templates run the random-weight model in fp32 (see deployments/*.yaml); a real
# model serves in the dtype its checkpoint names.
GPU_MODEL_DTYPE = "auto"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class DeployTarget:
    """Where the advised YAML will run."""

    accelerator: Literal["cpu", "gpu"] = "cpu"
    model: str | None = None  # a Hugging Face id or a local folder; None keeps the template's
    rate: float | None = None  # req/s to size for
    devices: int | None = None  # a device budget; default: the winner's measured devices
    devices_per_node: int = 8
    device_gib: float = 80.0


@dataclass
class Plan:
    """The sized deployment, the layouts it was chosen among, and what to know about it."""

    sizing: Sizing | None
    pareto: list[Sizing]
    tp_degrees: list[int] = field(default_factory=list)  # those the model allows
    notes: list[str] = field(default_factory=list)


def plan_deployment(
    measured: list[MeasuredSize],
    winner: str,
    pd: PDCapacities | None,
    target: DeployTarget,
    shape: ModelDims | None,
) -> Plan:
    chosen = next(size for size in measured if size.shape == winner)
    capacities = pd if winner in sizing.PD_SHAPES else None
    plan = Plan(None, [])
    if shape is not None:
        chosen = _with_tensor_parallel_floor(plan, chosen, shape, target)
    adjusted = chosen not in measured
    sized: Sizing | None = None
    if target.rate is not None:
        sized = sizing.size_for_rate(chosen, target.rate, capacities)
        if sized is None:
            plan.notes.append(
                f"{winner} cannot reach {target.rate:g} req/s (it holds one engine or met the"
                " objectives at no rate); sized for the device budget instead"
            )
    if sized is None:
        sized = sizing.size_for_devices(chosen, target.devices or chosen.devices, capacities)
    if sized is not None and adjusted:
        sized = dataclasses.replace(sized, measured=False)
    plan.sizing = sized
    largest = max(target.devices or 0, 2 * max(size.devices for size in measured))
    if sized is not None:
        largest = max(largest, sized.devices)
    plan.pareto = sizing.pareto_points(measured, largest, pd)
    return plan


def _with_tensor_parallel_floor(
    plan: Plan, chosen: MeasuredSize, shape: ModelDims, target: DeployTarget
) -> MeasuredSize:
    """``chosen`` with engines of the smallest degree whose share of the weights fits
    the target's devices, where that is above the measured degree."""
    plan.tp_degrees = shape.tp_degrees(target.devices_per_node)
    floor = shape.smallest_fitting_tp(
        target.devices_per_node, target.device_gib, DEFAULT_GPU_MEMORY_UTILIZATION
    )
    weights = f"the weights ({shape.weight_bytes / 2**30:.1f} GiB)"
    if floor is None:
        plan.notes.append(
            f"{weights} fit no allowed degree {plan.tp_degrees} on {target.device_gib:g} GiB"
            " devices"
        )
        return chosen
    if chosen.ranks_per_engine >= floor:
        return chosen
    plan.notes.append(
        f"each engine needs tensor parallel {floor} for {weights} on {target.device_gib:g}"
        f" GiB devices; measured at {chosen.ranks_per_engine}, so its goodput is assumed"
        " to scale with devices (fitted, not measured)"
    )
    scale = floor / chosen.ranks_per_engine
    layout = dataclasses.replace(chosen.layout, ranks_per_engine=floor)
    return dataclasses.replace(chosen, layout=layout, goodput=chosen.goodput * scale)


def write_yaml(
    plan: Plan,
    template: dict[str, Any],
    target: DeployTarget,
    header: str,
    path: Path,
) -> Path:
    """The template (the winner's YAML, with the advisor's policy settings applied) with
    the plan's pools, for the target accelerator and model."""
    document = _sized_document(template, plan.sizing, target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(document, sort_keys=False))
    return path


def _sized_document(
    template: dict[str, Any], sized: Sizing | None, target: DeployTarget
) -> dict[str, Any]:
    document = yaml.safe_load(yaml.safe_dump(template))  # a deep copy
    args = document["applications"][0]["args"]
    if target.accelerator == "gpu":
        args["accelerator"] = "gpu"
        args["model"] = {**args.get("model", {}), "dtype": GPU_MODEL_DTYPE}
    if target.model is not None:
        args["model"] = {**args.get("model", {}), "source": target.model}
    if sized is not None:
        args["shape"] = _shape(args["shape"], sized)
        for pool in args["pools"]:
            _size_pool(pool, sized)
    for pool in args["pools"]:
        if target.accelerator == "gpu":
            for key in CPU_ONLY_POOL_KEYS:
                pool.pop(key, None)
        elif pool.get("cpu_binds") and len(pool["cpu_binds"]) != pool.get("replicas", 1):
            pool.pop("cpu_binds")  # the template's binds were for another count of engines
    return document


def _shape(template_shape: str, sized: Sizing) -> str:
    if template_shape == "pd" or template_shape in sizing.AUTO_POOL_SHAPES:
        return template_shape
    engines = sized.engines.get("mixed", 1)
    if engines > 1:
        return "dp"
    if sized.ranks_per_engine > 1 and template_shape != "pp":
        return "tp"
    return "single" if template_shape in sizing.MIXED_SHAPES else template_shape


def _size_pool(pool: dict[str, Any], sized: Sizing) -> None:
    pool["replicas"] = sized.engines.get(pool.get("role", "mixed"), pool.get("replicas", 1))
    degree = pool.get("tensor_parallel_size", 1) * pool.get("pipeline_parallel_size", 1)
    if sized.ranks_per_engine != degree:
        pool["tensor_parallel_size"] = sized.ranks_per_engine
        pool["pipeline_parallel_size"] = 1
