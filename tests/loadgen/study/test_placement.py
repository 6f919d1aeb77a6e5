"""The placement search's candidates, their YAMLs and the choice among them, without a
simulation (the search itself is served offline in tests/deployments/test_simulate.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from deployments.config import load_application
from loadgen.scheduling.eventloop import run_event_loop
from loadgen.scheduling.runner import RunError
from loadgen.study.advisor import Objectives
from loadgen.study.knee import KneeSearchConfig, KneeStep
from loadgen.study.placement import (
    SEARCH_SHAPES,
    Degree,
    ErrorBand,
    Placement,
    PoolPlacement,
    StepAt,
    error_band,
    placement_document,
    placements,
    profile_degrees,
    search,
)
from splitserve.latency.profile import load_profile

DEPLOYMENTS = Path(__file__).resolve().parents[3] / "deployments"
H100_DEGREES = [Degree(1), Degree(2), Degree(4)]
OBJECTIVES = Objectives(ttft_s=0.25, tpot_s=0.02, attainment=0.9)


def test_a_shipped_family_offers_its_members_degrees_and_a_file_its_own(tmp_path: Path) -> None:
    assert profile_degrees("h100-llama-3.1-8b") == H100_DEGREES
    assert profile_degrees("h100-llama-3.1-70b") == [Degree(4), Degree(4, 2), Degree(8)]
    load_profile("rtx2080s-llama-3.2-1b-tp1-pp2").save(tmp_path / "mine.yaml")
    assert profile_degrees(str(tmp_path / "mine.yaml")) == [Degree(1, 2)]
    with pytest.raises(ValueError, match="neither a profile file nor a shipped profile family"):
        profile_degrees("b200-llama-9")


def test_every_candidate_takes_the_whole_budget_once() -> None:
    found = placements(8, H100_DEGREES, SEARCH_SHAPES)
    assert all(candidate.devices == 8 for candidate in found)
    labels = [candidate.label for candidate in found]
    assert len(labels) == len(set(labels))
    by_shape = {shape: [c.label for c in found if c.shape == shape] for shape in SEARCH_SHAPES}
    assert by_shape["single"] == by_shape["tp"] == by_shape["pp"] == []  # no degree of 8
    assert by_shape["dp"] == ["dp 8 x TP1", "dp 4 x TP2", "dp 2 x TP4"]
    assert by_shape["auto"] == ["auto 8 x TP1", "auto 4 x TP2", "auto 2 x TP4"]
    # Every P:D ratio at each degree, both pools of one degree.
    assert len(by_shape["pd"]) == 7 + 3 + 1 == len(by_shape["pd_always"])
    assert "pd 6:2 x TP1" in by_shape["pd"] and "pd 1:1 x TP4" in by_shape["pd"]


def test_one_engine_modes_take_the_degree_of_the_whole_budget() -> None:
    degrees = [Degree(1), Degree(4), Degree(2, 2), Degree(1, 4)]
    found = {c.label for c in placements(4, degrees, ("single", "tp", "pp"))}
    assert found == {"tp TP4", "pp TP1xPP4"}  # no shape serves one TP x PP engine
    assert {c.label for c in placements(1, degrees, ("single", "dp"))} == {"single TP1"}


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="no placement search for shape 'ep'"):
        placements(8, H100_DEGREES, ("ep",))


@pytest.mark.parametrize("shape", SEARCH_SHAPES)
def test_every_candidate_yaml_is_a_valid_config(shape: str, tmp_path: Path) -> None:
    degrees = [*H100_DEGREES, Degree(8), Degree(4, 2), Degree(1, 8)]
    for candidate in placements(8, degrees, (shape,)):
        template = yaml.safe_load((DEPLOYMENTS / f"{shape}.yaml").read_text())
        document = placement_document(template, candidate, OBJECTIVES)
        path = tmp_path / f"{candidate.slug}.yaml"
        path.write_text(yaml.safe_dump(document))
        config = load_application(path).models[0]
        pools = [(p.role, p.replicas, p.tensor_parallel_size) for p in config.pools]
        expected = [(p.role, p.replicas, p.degree.tp) for p in candidate.pools]
        assert pools == expected, candidate.label


def test_a_candidate_keeps_its_templates_engine_arguments_and_takes_the_objectives() -> None:
    template = yaml.safe_load((DEPLOYMENTS / "pd.yaml").read_text())
    pools = (PoolPlacement("prefill", 6, Degree(1)), PoolPlacement("decode", 2, Degree(1)))
    document = placement_document(template, Placement("pd", pools), OBJECTIVES, model="m/x")
    args = document["applications"][0]["args"]
    assert args["accelerator"] == "gpu" and args["model"]["source"] == "m/x"
    assert args["model"]["dtype"] == "auto"
    for pool in args["pools"]:
        assert pool["engine_kwargs"] == {"scheduling_policy": "priority"}
        assert "cpu_binds" not in pool and "kv_cache_gib" not in pool
    assert [pool["replicas"] for pool in args["pools"]] == [6, 2]
    assert args["qos"]["ttft_slo_s"] == 0.25
    assert args["qos"]["early_rejection_s"] == {"low": 0.25}  # never past the objective
    assert args["prefill_policy"]["remote_ttft_max_s"] == 0.125
    assert template["applications"][0]["args"]["pools"][0]["replicas"] == 1  # not changed


def _knee_at(goodput: dict[str, float]) -> tuple[list[tuple[str, float]], StepAt]:
    """A step function whose attainment falls below 0.9 above each label's goodput."""
    tried: list[tuple[str, float]] = []

    async def step_at(candidate: Placement, qps: float) -> KneeStep:
        tried.append((candidate.label, qps))
        if candidate.label not in goodput:
            raise RunError(f"{candidate.label} refused")
        met = 0.95 if qps <= goodput[candidate.label] else 0.5
        return KneeStep(qps, met, met * qps, qps, 0.1, 0.01)

    return tried, step_at


def test_the_search_finds_each_knee_and_the_best_placement() -> None:
    found = placements(4, H100_DEGREES, ("dp", "pd"))
    goodput = {"dp 4 x TP1": 40.0, "dp 2 x TP2": 30.0, "pd 1:3 x TP1": 20.0, "pd 2:2 x TP1": 55.0}
    goodput |= {"pd 3:1 x TP1": 10.0, "pd 1:1 x TP2": 0.5}
    tried, step_at = _knee_at(goodput)
    knee = KneeSearchConfig(attainment=0.9, qps_start=8, qps_max=1e6, tolerance=0.05)
    result = run_event_loop(search(found, step_at, knee, "h100-llama-3.1-8b"))
    assert result.winner is not None and result.winner.placement.label == "pd 2:2 x TP1"
    for searched in result.searched:
        true = goodput[searched.placement.label]
        assert searched.goodput <= true and searched.goodput >= true / 1.05 - 1e-9
    # Each search after the first starts at the best knee so far (rounded down).
    first_rates = [qps for label, qps in tried if label == "dp 2 x TP2"]
    assert first_rates[0] == 39.0  # dp 4 x TP1's knee, 39.7, to two digits
    assert "1.3" in result.reason or "1.4" in result.reason  # 55 against dp's 40


def test_a_simpler_placement_within_five_percent_wins_and_a_refused_one_is_kept_aside() -> None:
    found = placements(4, H100_DEGREES, ("dp", "pd"))
    goodput = {"dp 4 x TP1": 100.0, "pd 2:2 x TP1": 103.0}
    _, step_at = _knee_at(goodput)
    knee = KneeSearchConfig(attainment=0.9, qps_start=100, qps_max=1e6, tolerance=0.01)
    result = run_event_loop(search(found, step_at, knee, "p"))
    assert result.winner is not None and result.winner.placement.label == "dp 4 x TP1"
    assert "fewer moving parts" in result.reason
    refused = [s for s in result.searched if s.error is not None]
    assert {s.placement.label for s in refused} == {
        c.label for c in found if c.label not in goodput
    }
    assert all(s.goodput == 0 for s in refused)
    assert not math.isnan(result.wall_s)


def test_a_shipped_gpu_family_carries_its_held_out_error_and_a_cpu_fit_none() -> None:
    band = error_band("h100-llama-3.1-8b")
    assert band is not None and band.runs >= 10
    assert 0 < band.goodput <= band.goodput_worst < 1 and 0 < band.ttft < 1
    assert "held-out public runs" in str(band)
    assert error_band("rtx2080s-llama-3.2-1b") is None  # no public run of it to hold out


def test_knees_closer_than_the_profiles_error_are_a_tie_the_simpler_wins() -> None:
    """9% apart: beyond the search's 5% but within a profile whose held-out throughput
    error is 12%, so the simulation cannot say pd is better; without the band it can."""
    found = placements(4, H100_DEGREES, ("dp", "pd"))
    goodput = {"dp 4 x TP1": 100.0, "pd 2:2 x TP1": 109.0}
    _, step_at = _knee_at(goodput)
    knee = KneeSearchConfig(attainment=0.9, qps_start=100, qps_max=1e6, tolerance=0.01)
    wide = ErrorBand(goodput=0.12, goodput_worst=0.2, ttft=0.2, tpot=0.05, runs=18)
    result = run_event_loop(search(found, step_at, knee, "p", band=wide))
    assert result.winner is not None and result.winner.placement.label == "dp 4 x TP1"
    assert "held-out error" in result.reason and result.band is wide
    plain = run_event_loop(search(found, step_at, knee, "p"))
    assert plain.winner is not None and plain.winner.placement.label == "pd 2:2 x TP1"
