"""The public runs the GPU profiles are fitted on and checked against: they load, their
per-request lengths are the ones their sources totalled, the calibration and held-out
sets never share a run, and every shipped GPU profile names both."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from splitserve.latency.catalog import FITTED, SHIPPED, catalog_profile
from splitserve.latency.profile import load_profile
from splitserve.latency.published import (
    CALIBRATION,
    published_runs,
    replay_specs,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from sim_published import replay, shipped_profile_path


def test_every_calibration_run_is_published_and_replayable() -> None:
    replayable = {spec.run.id for spec in replay_specs()}
    assert set(CALIBRATION) <= replayable


def test_replayed_lengths_total_what_the_sources_counted() -> None:
    runs = {run.id: run for run in published_runs()}
    for spec in replay_specs():
        if spec.lengths != "published":
            continue
        run = runs[spec.run.id]
        assert len(spec.requests) == run.workload.num_prompts
        prompts = sum(request.prompt_tokens for request in spec.requests)
        outputs = sum(0 if r.silent else r.max_tokens for r in spec.requests)
        assert (prompts, outputs) == (
            run.results.total_input_tokens,
            run.results.total_output_tokens,
        ), run.id


@pytest.mark.parametrize("device", ["h100", "a100"])
def test_a_device_is_fitted_on_its_calibration_runs_and_judged_on_the_others(device: str):
    terms = FITTED[device]
    assert terms.calibration_runs and terms.held_out_runs
    assert not set(terms.calibration_runs) & set(terms.held_out_runs)
    assert set(terms.calibration_runs) <= set(CALIBRATION)
    devices = {spec.run.id: spec.device for spec in replay_specs()}
    assert {devices[run] for run in terms.calibration_runs + terms.held_out_runs} == {device}
    assert terms.held_out_error  # the advisor's band


@pytest.mark.parametrize("setup", [s for s in SHIPPED if s[0] in ("h100", "a100")])
def test_every_shipped_gpu_profile_names_its_calibration_and_held_out_runs(
    setup: tuple[str, str, int, int],
):
    profile = catalog_profile(*setup)
    terms = FITTED[setup[0]]
    assert profile.calibration_runs == terms.calibration_runs
    assert profile.held_out_runs == terms.held_out_runs
    assert profile.vllm_version == "0.6.0"
    assert profile.per_sequence_s == terms.per_sequence_s > 0
    assert profile.request_overhead_s == terms.request_overhead_s > 0


def test_a_replay_of_a_calibration_run_lands_within_its_fit() -> None:
    """Ten prompts at once on one H100 (calibration): the replay's figures are within
    the fit's worst calibration error of the published ones."""
    (spec,) = [s for s in replay_specs() if s.run.id == CALIBRATION[0]]
    result = replay(spec, shipped_profile_path(spec))
    worst = FITTED["h100"].calibration_error
    for figure, ratio in result.ratios().items():
        assert abs(ratio - 1) <= worst[f"{figure} worst"] + 0.01, figure
    assert load_profile(shipped_profile_path(spec).stem).calibration_runs
