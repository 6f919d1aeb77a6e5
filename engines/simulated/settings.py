"""A simulated engine's profile and scheduler limits, from its spec: the profile the
YAML names (``engine.profile``), for the pool's TP and PP degrees, and vLLM's own engine
arguments where the pool sets them (``max_num_seqs``, ``max_num_batched_tokens``,
``scheduling_policy``, ``num_gpu_blocks_override``), so one YAML serves vLLM or its
simulation."""

from __future__ import annotations

from pathlib import Path

from engines.settings import EngineSpec
from engines.simulated.scheduler import SchedulerLimits
from splitserve.latency.profile import LatencyProfile, load_profile, shipped_profiles

# kv_transfer_params key of a simulated prefill's answer: the prompt tokens whose KV the
# decode engine waits for (the hand-over's size).
SIMULATED_KV_TOKENS = "simulated_kv_tokens"


def profile_name(base: str, tensor_parallel_size: int, pipeline_parallel_size: int) -> str:
    """A shipped profile's name for one parallel degree: ``h100-llama-3.1-8b-tp2-pp1``."""
    return f"{base}-tp{tensor_parallel_size}-pp{pipeline_parallel_size}"


def resolve_profile(
    name_or_path: str, tensor_parallel_size: int, pipeline_parallel_size: int
) -> LatencyProfile:
    """The profile for a pool: a file, a shipped profile by its full name, or a shipped
    family (``h100-llama-3.1-8b``) whose member for the pool's degrees is taken."""
    degrees = (tensor_parallel_size, pipeline_parallel_size)
    if Path(name_or_path).exists() or name_or_path in shipped_profiles():
        profile = load_profile(name_or_path)
    else:
        member = profile_name(name_or_path, *degrees)
        if member not in shipped_profiles():
            family = sorted(p for p in shipped_profiles() if p.startswith(name_or_path + "-tp"))
            known = ", ".join(family) if family else ", ".join(shipped_profiles())
            raise ValueError(
                f"engine.profile {name_or_path!r}: no profile for tensor_parallel_size"
                f" {degrees[0]} and pipeline_parallel_size {degrees[1]}; shipped: {known}"
            )
        profile = load_profile(member)
    got = (profile.tensor_parallel_size, profile.pipeline_parallel_size)
    if got != degrees:
        raise ValueError(
            f"engine.profile {name_or_path!r} is for TP {got[0]} x PP {got[1]}, but the pool"
            f" runs TP {degrees[0]} x PP {degrees[1]}"
        )
    return profile


def engine_profile(spec: EngineSpec) -> LatencyProfile:
    if spec.backend.profile is None:
        raise ValueError("engine.backend 'simulated' needs engine.profile")
    pool = spec.pool
    return resolve_profile(
        spec.backend.profile, pool.tensor_parallel_size, pool.pipeline_parallel_size
    )


def scheduler_limits(spec: EngineSpec, profile: LatencyProfile) -> SchedulerLimits:
    kwargs = spec.pool.engine_kwargs
    block_size = spec.model.block_size or profile.block_size
    blocks = kwargs.get("num_gpu_blocks_override") or profile.kv_capacity_tokens // block_size
    return SchedulerLimits(
        max_num_seqs=int(kwargs.get("max_num_seqs") or profile.max_num_seqs),
        max_num_batched_tokens=int(
            kwargs.get("max_num_batched_tokens") or profile.max_num_batched_tokens
        ),
        block_size=block_size,
        num_blocks=int(blocks),
        policy="priority" if kwargs.get("scheduling_policy") == "priority" else "fcfs",
        enable_prefix_caching=spec.model.enable_prefix_caching,
        kv_load_steps=profile.handover_load_steps,
    )
