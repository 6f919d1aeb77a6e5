"""A simulated engine's profile and scheduler limits, from its spec: the profile the
YAML names (``engine.profile``), for the pool's TP and PP degrees, and vLLM's own engine
arguments where the pool sets them (``max_num_seqs``, ``max_num_batched_tokens``,
``scheduling_policy``, ``num_gpu_blocks_override``), so one YAML serves vLLM or its
simulation.

A pool that names ``num_scheduler_steps`` (V0's multi-step scheduling, which V1 has
not: only the simulated backend takes it; 1 for V0 without it) replays vLLM 0.6.0's V0
engine (engines/simulated/scheduler.py), and then ``enable_chunked_prefill`` is read as
V0 read it: off unless set, as 0.6.0's default for a max_model_len up to 32K, and off
means prefill-only steps. Without ``num_scheduler_steps`` the engines schedule as the
installed vLLM (V1) does, which batches decodes beside every prompt whether it chunks
prompts or not, so one YAML means the same on both backends. Without chunked prefill the
token budget defaults to 0.6.0's ``max(max_model_len, 2048)`` (``SchedulerConfig`` in vllm/config.py
of commit 32e7db25365415841ebc7c4215851743fbb1bad1, multi-step or not), and one below
max_model_len is refused, as 0.6.0 refuses it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.settings import EngineSpec, ModelConfig, PoolConfig
from engines.simulated.scheduler import SchedulerLimits
from splitserve.latency.profile import LatencyProfile, load_profile, shipped_profiles

# kv_transfer_params key of a simulated prefill's answer: the prompt tokens whose KV the
# decode engine waits for (the hand-over's size).
SIMULATED_KV_TOKENS = "simulated_kv_tokens"

# The engine arguments that choose V0's scheduling: what the simulation reads of them is
# V0's meaning, not the installed vLLM's.
V0_SCHEDULING_ARGS = ("enable_chunked_prefill", "num_scheduler_steps")
# vLLM 0.6.0's token budget without chunked prefill: max(max_model_len, this).
V0_MIN_BATCHED_TOKENS = 2048


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
    return pool_limits(spec.pool, spec.model, profile)


def pool_limits(pool: PoolConfig, model: ModelConfig, profile: LatencyProfile) -> SchedulerLimits:
    """The scheduler limits of a pool's engines; ValueError for engine_kwargs that vLLM
    0.6.0 would refuse together."""
    kwargs = pool.engine_kwargs
    block_size = model.block_size or profile.block_size
    blocks = kwargs.get("num_gpu_blocks_override") or profile.kv_capacity_tokens // block_size
    chunked_prefill, steps = scheduling_modes(kwargs)
    return SchedulerLimits(
        max_num_seqs=int(kwargs.get("max_num_seqs") or profile.max_num_seqs),
        max_num_batched_tokens=_batched_tokens(kwargs, chunked_prefill, model, profile),
        block_size=block_size,
        num_blocks=int(blocks),
        policy="priority" if kwargs.get("scheduling_policy") == "priority" else "fcfs",
        enable_prefix_caching=model.enable_prefix_caching,
        kv_load_steps=profile.handover_load_steps,
        chunked_prefill=chunked_prefill,
        scheduler_steps=steps,
    )


def scheduling_modes(kwargs: dict[str, Any]) -> tuple[bool, int]:
    """(chunked prefill, scheduler steps) that a pool's engine_kwargs ask for."""
    if "num_scheduler_steps" not in kwargs:
        return True, 1  # V1's mixed batches (see the module's docstring)
    steps = kwargs.get("num_scheduler_steps", 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"engine_kwargs.num_scheduler_steps must be a whole number of at least 1, got {steps!r}"
        )
    chunked = kwargs.get("enable_chunked_prefill")
    if chunked is None:
        chunked = steps == 1
    if chunked and steps > 1:
        raise ValueError(
            "engine_kwargs.num_scheduler_steps > 1 needs enable_chunked_prefill false:"
            " vLLM 0.6.0 refuses chunked prefill with multi-step scheduling"
        )
    return bool(chunked), steps


def _batched_tokens(
    kwargs: dict[str, Any], chunked_prefill: bool, model: ModelConfig, profile: LatencyProfile
) -> int:
    budget = kwargs.get("max_num_batched_tokens")
    if chunked_prefill:
        return int(budget or profile.max_num_batched_tokens)
    max_model_len = model.max_model_len or profile.max_model_len
    budget = int(budget or max(max_model_len, V0_MIN_BATCHED_TOKENS))
    if budget < max_model_len:
        raise ValueError(
            f"engine_kwargs.max_num_batched_tokens {budget} is below max_model_len"
            f" {max_model_len}: without chunked prefill a prompt runs whole in one step, and"
            " vLLM 0.6.0 refuses a budget that would cut max_model_len"
        )
    return budget
