"""StepTimes: a profile's step times as an engine lives them, spread where the profile
measured a spread, and the same again for the same engine."""

from __future__ import annotations

import statistics

import pytest
from pydantic import ValidationError

from splitserve.latency.profile import LatencyProfile, StepShape, StepTimes, load_profile

PROFILE = load_profile("h100-llama-3.1-8b-tp1-pp1")  # any profile: the roofline's have no spread
DECODE = StepShape(decode_seqs=4, decode_context_tokens=400)
SPREAD = [0.5, 1.0, 2.5]


def test_without_a_spread_every_step_takes_its_fitted_time() -> None:
    times = StepTimes(PROFILE, "engine-0")
    assert times.step(DECODE) == PROFILE.step_seconds(DECODE)
    assert times.decode_run_ends(4, 400, 5) == PROFILE.decode_run_ends(4, 400, 5)


def test_steps_draw_from_the_spread_and_replay_for_the_same_engine() -> None:
    spread = PROFILE.model_copy(update={"step_spread": SPREAD})
    fitted = PROFILE.step_seconds(DECODE)

    def steps_of(engine: str, count: int) -> list[float]:
        times = StepTimes(spread, engine)
        return [times.step(DECODE) for _ in range(count)]

    steps = steps_of("engine-0", 3000)
    assert {round(step / fitted, 6) for step in steps} == set(SPREAD)
    # Equally likely: the mean is the spread's.
    assert statistics.mean(steps) / fitted == pytest.approx(statistics.mean(SPREAD), rel=0.05)
    assert steps_of("engine-0", 20) == steps[:20]
    assert steps_of("engine-1", 20) != steps[:20]


def test_a_decode_run_draws_each_of_its_steps() -> None:
    spread = PROFILE.model_copy(update={"step_spread": SPREAD})
    fitted = PROFILE.decode_run_ends(4, 400, 50)
    drawn = StepTimes(spread, "engine-0").decode_run_ends(4, 400, 50)
    fitted_steps = [b - a for a, b in zip([0.0, *fitted], fitted, strict=False)]
    drawn_steps = [b - a for a, b in zip([0.0, *drawn], drawn, strict=False)]
    ratios = {round(d / f, 6) for d, f in zip(drawn_steps, fitted_steps, strict=True)}
    assert ratios == set(SPREAD)


@pytest.mark.parametrize("spread", [[-0.1, 1.0], [0.0, 0.0]])
def test_a_spread_is_of_ratios_to_a_step(spread: list[float]) -> None:
    with pytest.raises(ValidationError, match="none below 0, some above"):
        LatencyProfile.model_validate({**PROFILE.model_dump(), "step_spread": spread})
