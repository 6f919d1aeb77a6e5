"""The auto pool's prefill policy (``cost``) and the measured KV hand-over cost it
reads, as pure functions."""

from __future__ import annotations

from typing import TypedDict

import pytest

from kv_transfer.metrics import TransferTotals
from router.policies.prefill_policies import CostSettings, cheaper_side
from router.policies.prefill_policy import PrefillDecision, PrefillInputs
from router.pool.stats_poller import TransferCostMeter
from router.settings import QoSConfig

COST = CostSettings(
    prompt_length_threshold=256, decode_load_threshold=4, max_transfer_s=0.25, min_ttft_gain=0.0
)
QOS = QoSConfig(enabled=True, ttft_slo_s=2.0, low_priority_remote_max_queue=2)


def _where_why(decision: PrefillDecision) -> tuple[str, str]:
    return decision.where, decision.reason


def _decide(
    prompt: int = 1000,
    cached: int = 0,
    *,
    remote: float | None = 0.5,
    local: float | None = 0.5,
    decode_active: int = 0,
    prefill_active: int = 0,
    transfer: float | None = 0.01,
    queue: int = 0,
    priority: str = "normal",
    settings: CostSettings = COST,
    qos: QoSConfig = QOS,
) -> tuple[str, str]:
    inputs = PrefillInputs(
        prompt_len=prompt,
        prefix_cached_len=cached,
        prefill_queue=queue,
        decode_active=decode_active,
        priority=priority,  # type: ignore[arg-type]
        remote_ttft_s=remote,
        local_ttft_s=local,
        prefill_active=prefill_active,
        transfer_s=transfer,
    )
    return _where_why(cheaper_side(inputs, settings, qos))


def test_a_prompt_short_after_its_prefix_hit_stays_where_it_decodes() -> None:
    assert _decide(prompt=255, remote=0.0, local=9.0) == ("local", "short_prompt")
    assert _decide(prompt=1000, cached=745, remote=0.0, local=9.0) == ("local", "short_prompt")
    assert _decide(prompt=1000, cached=744, remote=0.0, local=9.0) == ("remote", "remote_sooner")


def test_the_first_token_goes_where_it_comes_sooner_counting_the_hand_over() -> None:
    assert _decide(remote=0.2, local=0.5, transfer=0.1) == ("remote", "remote_sooner")
    # Sooner by the first token alone, but not once the KV has moved.
    assert _decide(remote=0.35, local=0.5, transfer=0.2) == ("local", "local_sooner")
    assert _decide(remote=0.5, local=0.2) == ("local", "local_sooner")


def test_remote_must_be_sooner_by_a_margin_not_by_noise() -> None:
    margin = COST.model_copy(update={"min_ttft_gain": 0.2})
    assert _decide(remote=0.26, local=0.32, transfer=0.0, settings=margin) == (
        "local",
        "local_sooner",
    )
    assert _decide(remote=0.2, local=0.32, transfer=0.0, settings=margin) == (
        "remote",
        "remote_sooner",
    )


def test_an_expensive_hand_over_keeps_the_prompt_local_whatever_else() -> None:
    assert _decide(remote=0.0, local=9.0, transfer=0.3, decode_active=50) == (
        "local",
        "transfer_too_slow",
    )


def test_an_unmeasured_hand_over_counts_as_free() -> None:
    assert _decide(remote=0.2, local=0.5, transfer=None) == ("remote", "remote_sooner")


class _Load(TypedDict):
    """Some of ``_decide``'s arguments, to pass along with others."""

    remote: float
    local: float
    decode_active: int


def test_a_busy_decode_engine_is_spared_by_a_less_busy_one_within_the_objective() -> None:
    busy: _Load = {"remote": 0.6, "local": 0.5, "decode_active": 4}
    assert _decide(**busy, prefill_active=3) == ("remote", "decode_busy")
    assert _decide(**busy, prefill_active=4) == ("local", "local_sooner")  # no fewer stalls
    calmer: _Load = {**busy, "decode_active": 3}
    assert _decide(**calmer, prefill_active=0) == ("local", "local_sooner")
    late: _Load = {**busy, "remote": 2.5, "local": 1.0}
    assert _decide(**late, prefill_active=0) == ("local", "remote_too_slow")
    limit = COST.model_copy(update={"remote_ttft_max_s": 0.55})
    assert _decide(**busy, prefill_active=0, settings=limit) == ("local", "remote_too_slow")
    qos_off = QoSConfig(enabled=False, ttft_slo_s=2.0)
    assert _decide(**late, prefill_active=0, qos=qos_off) == ("remote", "decode_busy")


def test_low_priority_keeps_to_its_engine_when_the_other_has_prefills_queued() -> None:
    assert _decide(remote=0.1, local=0.5, queue=2, priority="low") == ("local", "low_priority")
    assert _decide(remote=0.1, local=0.5, queue=1, priority="low") == ("remote", "remote_sooner")


def test_without_estimates_the_prompt_stays_local_and_says_so() -> None:
    assert _decide(remote=None, local=None) == ("local", "unmeasured")


def _snapshot(put_s: float, get_s: float, parts: int = 1, handovers: int = 1) -> TransferTotals:
    """The engines' summed statistics: each side's seconds over ``parts`` parts of
    ``handovers`` hand-overs."""
    totals = TransferTotals()
    for op, seconds in (("put", put_s), ("get", get_s)):
        totals.data["seconds_sum"][op] = seconds
        totals.data["parts"][op] = parts
        totals.data["handovers"][op] = handovers
    return totals


def test_the_meter_learns_seconds_per_transferred_token_between_polls() -> None:
    meter = TransferCostMeter(ema_weight=0.5)
    meter.update(_snapshot(0.0, 0.0, 0, 0), transferred_tokens=0)
    assert meter.estimate_s(1000) is None  # nothing moved yet
    meter.update(_snapshot(0.004, 0.006), transferred_tokens=1000)
    assert meter.estimate_s(1000) == pytest.approx(0.010)
    meter.update(_snapshot(0.004, 0.006), transferred_tokens=1000)  # idle: no sample
    assert meter.estimate_s(1000) == pytest.approx(0.010)
    meter.update(_snapshot(0.014, 0.026, parts=2, handovers=2), transferred_tokens=2000)
    assert meter.estimate_s(1000) == pytest.approx(0.020)  # halfway to the new 0.030


def test_the_meter_counts_tensor_parallel_parts_of_one_transfer_once() -> None:
    meter = TransferCostMeter(ema_weight=1.0)
    meter.update(_snapshot(0.0, 0.0, 0, 0), transferred_tokens=0)
    # Two ranks, each putting and loading its half side by side.
    meter.update(_snapshot(0.010, 0.010, parts=2, handovers=1), transferred_tokens=1000)
    assert meter.estimate_s(1000) == pytest.approx(0.010)


def test_an_engine_restart_gives_no_sample() -> None:
    meter = TransferCostMeter(ema_weight=1.0)
    meter.update(_snapshot(0.01, 0.01), transferred_tokens=1000)
    meter.update(_snapshot(0.02, 0.02, 2, 2), transferred_tokens=10)  # its count restarted
    assert meter.estimate_s(1000) is None
