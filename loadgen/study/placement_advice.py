"""``python -m loadgen advise --simulate PROFILE --devices N``: the placement search
(``loadgen/study/placement.py``) run offline, and what it writes: the winner's YAML, every
candidate's YAML, and a report of every candidate's knee."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from loadgen.config import RunConfig
from loadgen.scheduling.eventloop import run_event_loop
from loadgen.study import placement
from loadgen.study.advisor import Objectives
from loadgen.study.knee import KneeSearchConfig, KneeStep, step_of
from loadgen.study.placement import Placement, Searched, SearchResult
from loadgen.study.simulate import OfflineRates, SimulatedTarget, SimulatorWorker

# No ceiling of our own: the knee of a large budget is wherever the objectives break.
SEARCH_QPS_MAX = 1e6
# Doubling from --qps-start up to a few thousand req/s, then bisecting to 5%.
SEARCH_MAX_STEPS = 12


@dataclass(frozen=True)
class PlacementQuestion:
    """What the search is asked: a device type and budget, a workload, objectives."""

    profile: str
    devices: int
    run: RunConfig  # the workload, its request count and seed, and the SLOs
    objectives: Objectives
    shapes: tuple[str, ...]
    deployments_dir: Path
    devices_per_node: int = 8
    accelerator: str = "gpu"
    model: str | None = None
    qps_start: float = 1.0
    # Each run's arrivals span this long (at least run.num_requests requests).
    run_seconds: float | None = 20.0
    tolerance: float = 0.05  # the knees' resolution: as fine as the advisor's tie (TIE_SHARE)


def candidates_of(question: PlacementQuestion) -> list[Placement]:
    degrees = [
        degree
        for degree in placement.profile_degrees(question.profile)
        if degree.tp <= question.devices_per_node
    ]
    found = placement.placements(question.devices, degrees, question.shapes)
    if not found:
        shown = ", ".join(str(d) for d in degrees)
        raise ValueError(
            f"no placement of shapes {','.join(question.shapes)} takes exactly"
            f" {question.devices} devices with the profile's degrees ({shown})"
        )
    return found


def write_candidates(
    question: PlacementQuestion, candidates: list[Placement], folder: Path
) -> dict[Placement, Path]:
    """Each candidate's YAML, as it is simulated and as it would be served."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for candidate in candidates:
        document = _document(question, candidate)
        path = folder / f"{candidate.slug}.yaml"
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        paths[candidate] = path
    return paths


def _document(question: PlacementQuestion, candidate: Placement) -> dict[str, Any]:
    template = yaml.safe_load((question.deployments_dir / f"{candidate.shape}.yaml").read_text())
    return placement.placement_document(
        template, candidate, question.objectives, question.accelerator, question.model
    )


def search_offline(question: PlacementQuestion, out: Path, console: Console) -> SearchResult:
    candidates = candidates_of(question)
    paths = write_candidates(question, candidates, out / "placements")
    console.print(
        f"searching {len(candidates)} placements of {question.devices} devices on"
        f" {question.profile}, runs of {_run_length(question)}"
    )
    knee = KneeSearchConfig(
        attainment=question.objectives.attainment,
        qps_start=question.qps_start,
        qps_max=SEARCH_QPS_MAX,
        tolerance=question.tolerance,
        max_steps=SEARCH_MAX_STEPS,
    )
    with SimulatorWorker() as worker:
        rates = OfflineRates(question.run, worker, out / "simulation", question.run_seconds)
        first = SimulatedTarget(str(paths[candidates[0]]), question.profile)
        run_event_loop(rates.prepare(first, console))

        async def step_at(candidate: Placement, qps: float) -> KneeStep:
            target = SimulatedTarget(str(paths[candidate]), question.profile)
            return step_of(qps, await rates.run(target, qps))

        def progress(searched: Searched) -> None:
            if searched.error is not None:
                console.print(f"  {searched.placement.label:<28} not simulated: {searched.error}")
                return
            console.print(
                f"  {searched.placement.label:<28} {searched.goodput:8.2f} req/s"
                f"  ({len(searched.knee.steps)} runs, {searched.wall_s:.1f} s)"
            )

        band = placement.error_band(question.profile)
        result = run_event_loop(
            placement.search(candidates, step_at, knee, question.profile, progress, band)
        )
    result.workload = rates.prepared.plan.label
    result.mean_lengths = rates.prepared.plan.mean_lengths()
    return result


def advise_placement(
    question: PlacementQuestion, out: Path, yaml_path: Path, console: Console
) -> SearchResult:
    result = search_offline(question, out, console)
    write_winner(question, result, yaml_path)
    report = write_report(question, result, out, yaml_path)
    console.print(results_table(result))
    console.print(f"{result.reason}\n{_band_text(result)}\nYAML: {yaml_path}\nreport: {report}")
    return result


def write_winner(question: PlacementQuestion, result: SearchResult, path: Path) -> Path:
    winner = result.winner
    assert winner is not None
    document = _document(question, winner.placement)
    args = document["applications"][0]["args"]
    prompt, output = result.mean_lengths
    profile = {"prompt_tokens": round(prompt, 1), "output_tokens": round(output, 1)}
    if winner.goodput > 0:
        profile["request_rate"] = round(winner.goodput, 3)
    args.setdefault("router", {})["traffic_profile"] = profile
    header = (
        f"# Written by python -m loadgen advise --simulate {question.profile} --devices"
        f" {question.devices}: {winner.placement.label}, {result.reason}.\n"
        f"# Simulated, not measured: {result.runs} offline runs of"
        f" {result.workload} on the profile's time.\n"
        f"# {_band_text(result)}.\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(document, sort_keys=False))
    return path


def _run_length(question: PlacementQuestion) -> str:
    least = f"at least {question.run.num_requests} requests"
    if question.run_seconds is None:
        return f"{question.run.num_requests} requests"
    return f"{question.run_seconds:g} s of arrivals ({least})"


REPORT_COLUMNS = (
    "placement", "devices", "goodput req/s", "band req/s", "per device", "TTFT p50 ms",
    "TPOT p50 ms", "runs",
)  # fmt: skip


def _band_text(result: SearchResult) -> str:
    if result.band is None:
        return (
            f"Error unknown: {result.profile} was never replayed against public runs it was"
            " not fitted on"
        )
    return f"The profile's error: {result.band}"


def _band_cell(result: SearchResult, goodput: float) -> str:
    if result.band is None or goodput <= 0:
        return "-"
    low, high = result.band.range_of(goodput)
    return f"{low:.1f}-{high:.1f}"


def report_rows(result: SearchResult) -> list[tuple[str, ...]]:
    """Each placement's knee, best first: the console's table and the report's."""
    rows: list[tuple[str, ...]] = []
    for searched in result.ranked:
        step = searched.at_knee
        rows.append(
            (
                searched.placement.label,
                str(searched.placement.devices),
                f"{searched.goodput:.1f}",
                _band_cell(result, searched.goodput),
                f"{searched.goodput / result.devices:.2f}",
                _ms(step.ttft_p50_s if step else None),
                _ms(step.tpot_p50_s if step else None),
                str(len(searched.knee.steps)),
            )
        )
    return rows


def results_table(result: SearchResult) -> Table:
    table = Table(title=f"placements of {result.devices} devices on {result.profile}")
    for column in REPORT_COLUMNS:
        table.add_column(column, justify="left" if column == "placement" else "right")
    for row in report_rows(result):
        table.add_row(*row)
    return table


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}"


def write_report(
    question: PlacementQuestion, result: SearchResult, out: Path, yaml_path: Path
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    winner = result.winner
    assert winner is not None
    objectives = question.objectives
    lines = [
        f"# Placement of {question.devices} devices on {question.profile}",
        "",
        f"Workload {result.workload}, runs of {_run_length(question)};"
        f" objectives: TTFT {_ms(objectives.ttft_s)} ms, TPOT {_ms(objectives.tpot_s)} ms,"
        f" met by {objectives.attainment:.0%} of requests.",
        "",
        f"**{winner.placement.label}**: {result.reason}. YAML: `{yaml_path}`.",
        "",
        f"Simulated offline: {len(result.searched)} placements, {result.runs} runs in"
        f" {result.wall_s:.0f} s. Goodput is each placement's knee: the highest rate tried"
        f" whose attainment met the target (steps within {question.tolerance:.0%}).",
        f"{_band_text(result)}; goodputs within it of the best are ties, won by the simplest.",
        "",
        "| " + " | ".join(REPORT_COLUMNS) + " |",
        "|" + " --- |" * len(REPORT_COLUMNS),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in report_rows(result)]
    failed = [s for s in result.searched if s.error is not None]
    if failed:
        lines += ["", "Not simulated:", ""]
        lines += [f"- {s.placement.label}: {s.error}" for s in failed]
    markdown = out / "placement.md"
    markdown.write_text("\n".join(lines) + "\n")
    (out / "placement.json").write_text(json.dumps(_jsonable(result), indent=2))
    return markdown


def _jsonable(result: SearchResult) -> dict[str, Any]:
    return {
        "devices": result.devices,
        "profile": result.profile,
        "winner": result.winner.placement.label if result.winner else None,
        "reason": result.reason,
        "error_band": asdict(result.band) if result.band is not None else None,
        "wall_s": result.wall_s,
        "placements": [
            {
                "placement": s.placement.label,
                "shape": s.placement.shape,
                "pools": [asdict(pool) for pool in s.placement.pools],
                "goodput": s.goodput,
                "wall_s": s.wall_s,
                "error": s.error,
                "knee": s.knee.to_dict(),
            }
            for s in result.ranked
        ],
    }
