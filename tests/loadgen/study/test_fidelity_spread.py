"""The end-to-end fidelity ruler (bench/sim_fidelity.py, issue 56): a simulated figure
matches where its distance from the real rounds' median is inside the real rounds' own
distance from it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

# bench/ scripts import repo_first by name; appended, so bench/kv_transfer.py cannot
# shadow the package of that name.
sys.path.append(str(Path(__file__).resolve().parents[3] / "bench"))

from bench.sim_fidelity import METRICS, over_real, real_spread, spread_figures

CELL = {"config": "single", "workload": "general", "rate": 2.0}


def _row(kind: str, round_index: int, ttft: float) -> dict[str, Any]:
    figures = {metric: 10.0 for metric in METRICS} | {"ttft_p50_ms": ttft}
    return {**CELL, **figures, "kind": kind, "round": round_index}


def _compared(simulated_ttft: float, real: dict[str, float]) -> list[dict[str, Any]]:
    ratio = {metric: 1.0 for metric in METRICS} | {"ttft_p50_ms": simulated_ttft / real["ttft"]}
    return [{**CELL, "simulated_over_real": ratio}]


def test_the_spread_is_the_farthest_real_round_from_their_median() -> None:
    rows = [_row("real", i, ttft) for i, ttft in enumerate((90.0, 100.0, 120.0))]
    rows.append(_row("simulated", 0, 500.0))  # simulated rounds never widen it
    spread = real_spread(rows)[("single", "general", 2.0)]
    assert spread["ttft_p50_ms"] == pytest.approx(0.2)
    assert spread["itl_p50_ms"] == 0.0


def test_a_figure_matches_only_inside_the_real_spread() -> None:
    rows = [_row("real", i, ttft) for i, ttft in enumerate((90.0, 100.0, 110.0))]
    spread = real_spread(rows)
    (inside,) = [
        f
        for f in spread_figures(_compared(108.0, {"ttft": 100.0}), spread)
        if f["metric"] == "ttft_p50_ms"
    ]
    (outside,) = [
        f
        for f in spread_figures(_compared(112.0, {"ttft": 100.0}), spread)
        if f["metric"] == "ttft_p50_ms"
    ]
    assert inside["inside"] and not outside["inside"]
    assert outside["simulated_error"] == pytest.approx(0.12)
    assert outside["real_spread"] == pytest.approx(0.1)


def test_a_cell_with_one_real_round_has_no_spread_to_match() -> None:
    spread = real_spread([_row("real", 0, 100.0)])
    assert spread == {}
    assert spread_figures(_compared(100.0, {"ttft": 100.0}), spread) == []


def test_offline_runs_are_held_to_the_real_median() -> None:
    rows = [_row("real", i, ttft) for i, ttft in enumerate((90.0, 100.0, 110.0))]
    rows.append(_row("offline", 0, 105.0))
    (cell,) = over_real(rows, "offline")
    assert cell["simulated_over_real"]["ttft_p50_ms"] == pytest.approx(1.05)
    (figure,) = [
        f for f in spread_figures([cell], real_spread(rows)) if f["metric"] == "ttft_p50_ms"
    ]
    assert figure["inside"]
    assert over_real(rows, "simulated") == []  # no such runs
