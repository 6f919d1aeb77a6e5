"""The built-in PD prefill policies (see router/policies/prefill_policy.py): always, never,
conditional, cost.

``conditional`` follows the disaggregation chapter's ``should_offload_prefill`` (here
``should_prefill_remotely``), with two deliberate differences: a busy decode engine
only sends prompts to a prefill pool that is
not full (sending more work to a saturated pool lengthens everyone's TTFT, which is the
chapter's own argument for the queue check), and the priority rules of its QoS section
are part of the same decision.

``cost`` is for auto pools (shape ``auto``), where the engine that would prefill
remotely is decoding too: it weighs where the first token comes sooner, counting the
KV hand-over at its measured rate, and whose decodes the prefill would stall.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from router.policies.prefill_policy import PREFILL_POLICIES, PrefillDecision, PrefillInputs
from router.settings import QoSConfig
from splitserve.config_base import StrictModel

# In an auto pool the engine chosen to prefill can decode too, and for these two
# reasons a remote prefill would not pay: its decode request would queue on the planned decode
# engine behind the very work that made the peer sooner (remote_sooner; in
# bench/auto.py's summarization phase TPOT p50 109 ms against dp's 28), or join the
# busier batch (decode_busy). On the peer the first token comes as soon, with no KV
# hand-over, and no backlog of the first engine's stands between it and the rest
# (docs/DECISIONS.md). Other remote decisions stand.
PEER_SOONER = "peer_sooner"
PEER_LESS_BUSY = "peer_less_busy"


@PREFILL_POLICIES.register("always")
class AlwaysRemote:
    """The study's PD: every prompt is prefilled on the prefill pool."""

    settings_model: ClassVar[type[StrictModel]] = StrictModel

    def __init__(self, settings: StrictModel, qos: QoSConfig) -> None:
        pass

    def decide(self, inputs: PrefillInputs) -> PrefillDecision:
        return PrefillDecision("remote", "always")


@PREFILL_POLICIES.register("never")
class NeverRemote:
    """The decode engine prefills every prompt (the prefill pool idles)."""

    settings_model: ClassVar[type[StrictModel]] = StrictModel

    def __init__(self, settings: StrictModel, qos: QoSConfig) -> None:
        pass

    def decide(self, inputs: PrefillInputs) -> PrefillDecision:
        return PrefillDecision("local", "never")


class ConditionalSettings(StrictModel):
    prompt_length_threshold: int = Field(
        256, ge=1, description="Tokens left after the prefix-cache hit that make a prompt long."
    )
    prefill_queue_max: int = Field(
        10, ge=1, description="Prefill requests queued on a engine at which it counts as full."
    )
    decode_load_threshold: int = Field(
        8, ge=1, description="Active requests on the decode engine at which it counts as busy."
    )
    decode_busy_min_length: int = Field(
        64,
        ge=1,
        description="A busy decode engine sends prompts of at least this length to the"
        " prefill pool.",
    )
    remote_ttft_max_s: float | None = Field(
        None,
        gt=0,
        description="With QoS on, a long prompt goes remote only while the prefill pool's"
        " TTFT estimate for it is at most this, or the decode engine would not start it"
        " sooner (unset: qos.ttft_slo_s). Below the objective it leaves room for what the"
        " estimate cannot see: work that arrives after it.",
    )
    high_priority_bypasses_queue: bool = Field(
        True,
        description="High priority goes remote even to a full prefill queue (the engines'"
        " priority scheduling puts it first there).",
    )


@PREFILL_POLICIES.register("conditional")
class ConditionalPolicy:
    """Remote when the prompt left after the decode engine's prefix hit is long and the
    prefill pool has room, or when the decode engine is busy; priorities as in QoS."""

    settings_model: ClassVar[type[StrictModel]] = ConditionalSettings

    def __init__(self, settings: StrictModel, qos: QoSConfig) -> None:
        assert isinstance(settings, ConditionalSettings)
        self._settings = settings
        self._qos = qos

    def decide(self, inputs: PrefillInputs) -> PrefillDecision:
        return should_prefill_remotely(inputs, self._settings, self._qos)


def should_prefill_remotely(
    inputs: PrefillInputs, policy: ConditionalSettings, qos: QoSConfig
) -> PrefillDecision:
    """Where to prefill one prompt, by the chapter's rules (see the module docstring)."""
    queue = inputs.prefill_queue
    if _low_priority_kept_local(inputs, qos):
        return PrefillDecision("local", "low_priority")
    effective_len = max(0, inputs.prompt_len - inputs.prefix_cached_len)
    prefill_available = queue < policy.prefill_queue_max
    if effective_len >= policy.prompt_length_threshold:
        if prefill_available:
            if _remote_too_slow_and_local_sooner(inputs, policy, qos):
                return PrefillDecision("local", "remote_too_slow")
            return PrefillDecision("remote", "long_prompt")
        if inputs.priority == "high" and policy.high_priority_bypasses_queue:
            # The prefill pool is full of other work, which high priority overtakes; it
            # still goes where its own priority's queue gives the earlier first token.
            if _local_is_sooner(inputs):
                return PrefillDecision("local", "high_priority_sooner_local")
            return PrefillDecision("remote", "high_priority")
        return PrefillDecision("local", "prefill_queue_full")
    decode_busy = inputs.decode_active >= policy.decode_load_threshold
    if decode_busy and effective_len >= policy.decode_busy_min_length and prefill_available:
        return PrefillDecision("remote", "decode_busy", whole_on_peer=PEER_LESS_BUSY)
    if inputs.prompt_len >= policy.prompt_length_threshold:
        return PrefillDecision("local", "prefix_cached")
    return PrefillDecision("local", "short_prompt")


def _low_priority_kept_local(inputs: PrefillInputs, qos: QoSConfig) -> bool:
    """Remote prefill spends extra cluster resources for latency; under load they are
    kept for the requests that pay for it."""
    return inputs.priority == "low" and inputs.prefill_queue >= qos.low_priority_remote_max_queue


def _local_is_sooner(inputs: PrefillInputs) -> bool:
    remote, local = inputs.remote_ttft_s, inputs.local_ttft_s
    return remote is not None and local is not None and local < remote


def _remote_too_slow_and_local_sooner(
    inputs: PrefillInputs, policy: ConditionalSettings, qos: QoSConfig
) -> bool:
    """With QoS on, a prefill pool that is not full by count can still be too slow: a
    queue of long prompts ahead puts the first token past the objective. Prefilling
    remotely protects the decode engine's ITL, but not at the price of the TTFT objective when
    the decode engine would start the prompt sooner."""
    remote = inputs.remote_ttft_s
    limit = policy.remote_ttft_max_s or qos.ttft_slo_s
    return qos.enabled and remote is not None and remote > limit and _local_is_sooner(inputs)


class CostSettings(StrictModel):
    prompt_length_threshold: int = Field(
        256,
        ge=1,
        description="Tokens left after the prefix-cache hit below which a prompt is"
        " computed where it decodes: its hand-over would cost more than the stall it saves.",
    )
    decode_load_threshold: int = Field(
        4,
        ge=1,
        description="Active requests on the decode engine at which a long prompt is sent to"
        " an engine with fewer, so that its prefill stalls fewer streams.",
    )
    max_transfer_s: float = Field(
        0.25,
        gt=0,
        description="A KV hand-over expected to take longer than this (prompt tokens times"
        " the measured seconds per transferred token) keeps the prompt local: the second"
        " token waits for it.",
    )
    min_ttft_gain: float = Field(
        0.2,
        ge=0,
        lt=1,
        description="The share of the local TTFT estimate by which the remote one plus the"
        " hand-over must be sooner: per-token estimates of equal engines differ by noise,"
        " and a prompt handed over for noise costs a transfer for nothing.",
    )
    remote_ttft_max_s: float | None = Field(
        None,
        gt=0,
        description="To spare a busy decode engine, a prompt goes remote only while the"
        " other engine's TTFT estimate for it is at most this (unset: qos.ttft_slo_s with"
        " QoS on, no limit without).",
    )


@PREFILL_POLICIES.register("cost")
class CostPolicy:
    """Remote when another engine gives the first token (plus the KV hand-over) sooner,
    or when the decode engine is busy and the other engine stalls fewer streams."""

    settings_model: ClassVar[type[StrictModel]] = CostSettings

    def __init__(self, settings: StrictModel, qos: QoSConfig) -> None:
        assert isinstance(settings, CostSettings)
        self._settings = settings
        self._qos = qos

    def decide(self, inputs: PrefillInputs) -> PrefillDecision:
        return cheaper_side(inputs, self._settings, self._qos)


def cheaper_side(inputs: PrefillInputs, policy: CostSettings, qos: QoSConfig) -> PrefillDecision:
    """Where to prefill one prompt when either side could (see the module docstring)."""
    if _low_priority_kept_local(inputs, qos):
        return PrefillDecision("local", "low_priority")
    if inputs.prompt_len - inputs.prefix_cached_len < policy.prompt_length_threshold:
        return PrefillDecision("local", "short_prompt")
    transfer = inputs.transfer_s or 0.0
    if transfer > policy.max_transfer_s:
        return PrefillDecision("local", "transfer_too_slow")
    remote, local = inputs.remote_ttft_s, inputs.local_ttft_s
    if (
        remote is not None
        and local is not None
        and remote + transfer < local * (1 - policy.min_ttft_gain)
    ):
        return PrefillDecision("remote", "remote_sooner", whole_on_peer=PEER_SOONER)
    decode_busy = inputs.decode_active >= policy.decode_load_threshold
    if decode_busy and inputs.prefill_active < inputs.decode_active:
        limit = policy.remote_ttft_max_s or (qos.ttft_slo_s if qos.enabled else None)
        if remote is None or limit is None or remote <= limit:
            return PrefillDecision("remote", "decode_busy", whole_on_peer=PEER_LESS_BUSY)
        return PrefillDecision("local", "remote_too_slow")
    measured = remote is not None and local is not None
    return PrefillDecision("local", "local_sooner" if measured else "unmeasured")
