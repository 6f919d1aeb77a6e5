"""What the simulated-engine tests build alike: a scheduler of small limits, and a
profile of round numbers saved for a config to name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.simulated.scheduler import SchedulerLimits, SimScheduler
from splitserve.latency.profile import LatencyProfile

BLOCK = 4


def small_scheduler(**limits: Any) -> SimScheduler:
    """Eight sequences, a 64-token budget, 64 blocks of ``BLOCK``; ``limits`` override."""
    defaults: dict[str, Any] = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "block_size": BLOCK,
        "num_blocks": 64,
    }
    return SimScheduler(SchedulerLimits(**{**defaults, **limits}))


def round_profile(tmp_path: Path, step_s: float, **fields: Any) -> str:
    """A profile whose steps cost ``step_s`` and nothing per token unless ``fields`` say
    so, saved under ``tmp_path``; its path."""
    defaults: dict[str, Any] = {
        "device": "test",
        "model": "tiny",
        "source": "a test's round numbers",
        "step_overhead_s": step_s,
        "weights_read_s": 0.0,
        "compute_per_token_s": 0.0,
        "per_context_token_s": 0.0,
        "per_attention_pair_s": 0.0,
        "kv_bytes_per_token": 1000,
        "kv_capacity_tokens": 64 * 1024,
    }
    path = tmp_path / "profile.yaml"
    LatencyProfile(**{**defaults, **fields}).save(path)
    return str(path)
