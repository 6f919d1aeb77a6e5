"""The router's policy settings, as the ``split_policy:``, ``qos:`` and ``router:`` blocks
of a Serve YAML's ``args`` give them. Every threshold the router acts on lives here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Priority = Literal["high", "normal", "low"]
PRIORITIES: tuple[Priority, ...] = ("high", "normal", "low")
ReplicaChoiceName = Literal["round_robin", "least_loaded", "prefix_affinity"]
OffloadMode = Literal["always", "never", "conditional"]


class StrictSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SplitPolicyConfig(StrictSettings):
    """PD only: when a prompt is computed on the prefill pool rather than the decode replica."""

    mode: OffloadMode = Field(
        "conditional",
        description="always (the study's PD), never (decode prefills every prompt), conditional.",
    )
    prompt_length_threshold: int = Field(
        256, ge=1, description="Tokens left after the prefix-cache hit that make a prompt long."
    )
    prefill_queue_max: int = Field(
        10, ge=1, description="Prefill requests queued on a replica at which it counts as full."
    )
    decode_load_threshold: int = Field(
        8, ge=1, description="Active requests on the decode replica at which it counts as busy."
    )
    decode_busy_min_length: int = Field(
        64, ge=1, description="A busy decode replica offloads prompts of at least this length."
    )
    high_priority_bypasses_queue: bool = Field(
        True,
        description="High priority goes remote even to a full prefill queue (the engines'"
        " priority scheduling puts it first there).",
    )


class QoSConfig(StrictSettings):
    """Admission control: who is refused, when, and how they are told."""

    enabled: bool = False
    default_priority: Priority = "normal"
    ttft_slo_s: float = Field(
        2.0, gt=0, description="Time to first token promised to admitted requests."
    )
    early_rejection_s: dict[Priority, float] = Field(
        default_factory=lambda: {"low": 1.0},
        description="Per priority, the estimated TTFT above which it is refused (503); at most"
        " ttft_slo_s. Below the SLO it leaves headroom for the priorities never refused (the"
        " chapter's low_priority_threshold_ms).",
    )
    queue_caps: dict[Priority, int] = Field(
        default_factory=lambda: {"high": 256, "normal": 128, "low": 64},
        description="Requests waiting for their first token, router-wide, at which a request of"
        " this priority is refused (429).",
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After on a refusal, in seconds.")
    low_priority_remote_max_queue: int = Field(
        1,
        ge=0,
        description="PD: low priority is prefilled remotely only while the prefill queue is"
        " shorter than this.",
    )
    ema_weight: float = Field(
        0.2, gt=0, le=1, description="Weight of the newest sample in the per-token time averages."
    )
    min_prefill_tokens_per_sample: int = Field(
        64,
        ge=1,
        description="A first token after fewer prefill tokens than this says more about fixed"
        " overhead than per-token cost, so it does not update the average.",
    )

    @model_validator(mode="after")
    def _every_priority_capped(self) -> QoSConfig:
        missing = [p for p in PRIORITIES if p not in self.queue_caps]
        if missing:
            raise ValueError(f"queue_caps needs a cap for every priority; missing {missing}")
        loose = {p: s for p, s in self.early_rejection_s.items() if not 0 < s <= self.ttft_slo_s}
        if loose:
            raise ValueError(
                f"early_rejection_s must be above 0 and at most ttft_slo_s"
                f" ({self.ttft_slo_s:g} s); got {loose}"
            )
        return self


class PrefixAffinityConfig(StrictSettings):
    max_load_imbalance: int = Field(
        4,
        ge=0,
        description="Requests a replica may carry beyond the least loaded one before a"
        " prefix hit stops pulling traffic to it (one hot prefix must not pin one replica).",
    )
    min_hit_tokens: int = Field(1, ge=1, description="Shorter estimated hits count as no hit.")
