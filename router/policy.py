"""PD: whether a prompt is computed on the prefill pool (remote) or on the decode replica
that will generate the answer (local).

Pure functions of numbers the dispatcher gathers; the thresholds come from the
``split_policy:`` and ``qos:`` blocks. Follows the disaggregation chapter's
``should_offload_prefill``, with two deliberate differences: a busy decode replica only
offloads to a prefill pool that is not full (sending more work to a saturated pool
lengthens everyone's TTFT, which is the chapter's own argument for the queue check), and
the priority rules of its QoS section are part of the same decision.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from router.settings import Priority, QoSConfig, SplitPolicyConfig

Where = Literal["local", "remote"]


class OffloadDecision(NamedTuple):
    where: Where
    reason: str

    @property
    def remote(self) -> bool:
        return self.where == "remote"


def should_offload_prefill(
    prompt_len: int,
    prefix_cached_len: int,
    prefill_queue: int,
    decode_active: int,
    priority: Priority,
    policy: SplitPolicyConfig,
    qos: QoSConfig,
) -> OffloadDecision:
    """Where to prefill one prompt.

    prompt_len: prompt tokens; prefix_cached_len: of those, expected in the decode
    replica's prefix cache; prefill_queue: prefills queued or running on the prefill
    replica that would take it; decode_active: requests active on the decode replica.
    """
    if policy.mode == "always":
        return OffloadDecision("remote", "always")
    if policy.mode == "never":
        return OffloadDecision("local", "never")
    if priority == "low" and prefill_queue >= qos.low_priority_remote_max_queue:
        # Remote prefill spends extra cluster resources for latency; under load they are
        # kept for the requests that pay for it.
        return OffloadDecision("local", "low_priority")
    effective_len = max(0, prompt_len - prefix_cached_len)
    prefill_available = prefill_queue < policy.prefill_queue_max
    if effective_len >= policy.prompt_length_threshold:
        if prefill_available:
            return OffloadDecision("remote", "long_prompt")
        if priority == "high" and policy.high_priority_bypasses_queue:
            return OffloadDecision("remote", "high_priority")
        return OffloadDecision("local", "prefill_queue_full")
    decode_busy = decode_active >= policy.decode_load_threshold
    if decode_busy and effective_len >= policy.decode_busy_min_length and prefill_available:
        return OffloadDecision("remote", "decode_busy")
    if prompt_len >= policy.prompt_length_threshold:
        return OffloadDecision("local", "prefix_cached")
    return OffloadDecision("local", "short_prompt")
