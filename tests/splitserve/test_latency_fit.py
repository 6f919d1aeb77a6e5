"""The profile fit recovers the step terms that made its measurements, and says how far
off it is."""

from __future__ import annotations

import pytest

from splitserve.latency.fit import (
    UNMEASURED_LINK_BYTES_PER_S,
    DecodeSample,
    PrefillSample,
    StepFit,
    fit_handover,
    fit_steps,
    fitted_profile,
    handover_costs,
    nonnegative_least_squares,
)
from splitserve.latency.profile import LatencyProfile, StepShape

TRUE = LatencyProfile(
    device="made-up",
    model="made-up",
    source="the test",
    step_overhead_s=0.004,
    request_overhead_s=0.010,
    weights_read_s=0.008,  # four tokens' arithmetic: steps stop getting cheaper below 4
    compute_per_token_s=0.002,
    per_sequence_s=0.0005,  # a decode token dearer than a prefill token, as on a CPU
    per_context_token_s=1e-6,
    per_attention_pair_s=1e-8,
    kv_bytes_per_token=1024,
    kv_capacity_tokens=100_000,
    handover_bytes_per_s=1e9,
)


def _measured() -> tuple[list[PrefillSample], list[DecodeSample]]:
    prefills = []
    for tokens in (16, 64, 256, 1024):
        pairs = tokens * (tokens + 1) // 2
        seconds = TRUE.request_overhead_s + TRUE.step_seconds(
            StepShape(prefill_tokens=tokens, attention_pairs=pairs, prefill_seqs=1)
        )
        prefills.append(PrefillSample(tokens, seconds))
    decodes = []
    for batch in (1, 2, 4, 8, 16, 32):
        for context in (64, 512):
            shape = StepShape(decode_seqs=batch, decode_context_tokens=batch * context)
            decodes.append(DecodeSample(batch, batch * context, TRUE.step_seconds(shape)))
    return prefills, decodes


def _profile_of(fit: StepFit) -> LatencyProfile:
    return fitted_profile(
        fit,
        source="measured",
        device="d",
        model="m",
        kv_bytes_per_token=1,
        kv_capacity_tokens=1,
        handover_bytes_per_s=1.0,
    )


def test_the_fit_recovers_the_terms_that_made_the_measurements() -> None:
    fit = fit_steps(*_measured())
    assert fit.step_overhead_s == pytest.approx(TRUE.step_overhead_s, rel=1e-3)
    assert fit.request_overhead_s == pytest.approx(TRUE.request_overhead_s, rel=1e-3)
    assert fit.weights_read_s == pytest.approx(TRUE.weights_read_s, rel=1e-3)
    assert fit.compute_per_token_s == pytest.approx(TRUE.compute_per_token_s, rel=1e-3)
    assert fit.per_sequence_s == pytest.approx(TRUE.per_sequence_s, rel=1e-3)
    assert fit.per_context_token_s == pytest.approx(TRUE.per_context_token_s, rel=1e-3)
    assert fit.per_attention_pair_s == pytest.approx(TRUE.per_attention_pair_s, rel=1e-3)
    assert fit.errors["decode_max"] < 1e-6


def test_a_per_sequence_cost_is_what_a_decode_token_costs_over_a_prefill_token() -> None:
    """The fitted profile charges a batch's requests their own cost each step, so a batch
    of 32 decodes costs more than a 32-token prefill's linear part, by 32 requests'."""
    profile = _profile_of(fit_steps(*_measured()))
    decode = profile.step_seconds(StepShape(decode_seqs=32))
    prefill = profile.step_seconds(StepShape(prefill_tokens=32, prefill_seqs=1))
    assert decode - prefill == pytest.approx(31 * TRUE.per_sequence_s, rel=1e-3)
    runs = profile.decode_run_ends(batch=32, context_tokens=0, steps=1)
    assert runs[0] == pytest.approx(decode, rel=1e-9)


def test_a_fitted_profile_records_its_error_and_source() -> None:
    prefills, decodes = _measured()
    noisy = [DecodeSample(s.batch, s.context_tokens, s.seconds * 1.1) for s in decodes[:3]]
    fit = fit_steps(prefills, noisy + decodes[3:])
    profile = _profile_of(fit)
    assert profile.fit_error["decode_max"] > 0.01
    assert profile.source == "measured"


def test_coefficients_are_never_negative() -> None:
    import numpy as np

    features = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    falling = np.array([3.0, 2.0, 1.0])  # a negative slope would fit best
    coefficients = nonnegative_least_squares(features, falling)
    assert (coefficients >= 0).all()
    assert coefficients[1] == 0.0


def test_a_fit_needs_both_kinds_of_measurement() -> None:
    prefills, _ = _measured()
    with pytest.raises(ValueError, match="two prefill and two decode"):
        fit_steps(prefills, [])


def _through_pd(latency_s: float, seconds_per_token: float) -> list[PrefillSample]:
    """Lone prefills through a PD application whose hand-over costs so much: the prefill
    on one engine, then the decode engine's overhead and its step of the last token."""
    prefills, _ = _measured()
    samples = []
    for sample in prefills:
        tokens = sample.prompt_tokens
        last = StepShape(prefill_tokens=1, attention_pairs=tokens, prefill_seqs=1)
        load = TRUE.handover_load_steps * TRUE.step_seconds(StepShape(kv_loads=1))
        decode_side = TRUE.request_overhead_s + load + TRUE.step_seconds(last)
        handover = latency_s + seconds_per_token * tokens
        samples.append(PrefillSample(tokens, sample.seconds + handover + decode_side))
    return samples


def test_the_handover_fit_recovers_the_link_that_made_the_measurements() -> None:
    prefills, _ = _measured()
    costs = handover_costs(prefills, _through_pd(0.002, 8e-6), TRUE)
    assert [cost.seconds for cost in costs] == pytest.approx(
        [0.002 + 8e-6 * cost.prompt_tokens for cost in costs]
    )
    fit = fit_handover(costs)
    assert fit.latency_s == pytest.approx(0.002)
    assert fit.seconds_per_token == pytest.approx(8e-6)
    assert fit.bytes_per_s(TRUE.kv_bytes_per_token) == pytest.approx(1024 / 8e-6)


def test_a_free_link_is_recorded_as_one_the_fit_cannot_tell_from_free() -> None:
    prefills, _ = _measured()
    fit = fit_handover(handover_costs(prefills, _through_pd(0.001, 0.0), TRUE))
    assert fit.seconds_per_token == pytest.approx(0.0, abs=1e-12)
    assert fit.latency_s == pytest.approx(0.001)
    # Noise that makes a long prompt's hand-over cheaper never gives a negative rate.
    noisy = [PrefillSample(16, 0.003), PrefillSample(1024, 0.001)]
    assert fit_handover(noisy).seconds_per_token == 0.0
    assert fit_handover(noisy).bytes_per_s(1024) == UNMEASURED_LINK_BYTES_PER_S


def test_a_handover_fit_needs_the_same_prompt_lengths_on_one_engine() -> None:
    prefills, _ = _measured()
    with pytest.raises(ValueError, match=r"\[2048\] tokens"):
        handover_costs(prefills, [PrefillSample(2048, 0.5)], TRUE)
    with pytest.raises(ValueError, match="two or more prompt lengths"):
        fit_handover([PrefillSample(16, 0.003)])
