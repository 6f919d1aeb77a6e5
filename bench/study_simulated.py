"""The study's matrix on simulated GPUs: which shape wins where? (benchmark, not a test)

The reference study (../shared/reference/000) served Llama-3.2-1B-Instruct on two RTX
2080 SUPER over PCIe as TP=2, PP=2, DP=2 and PD, under its three synthetic workloads and
BurstGPT subsets at QPS 1, 2, 4, 8 and unlimited, 200 requests per cell. Here every cell
runs offline (python -m loadgen simulate: the router's decisions over simulated engines
in virtual time) on the shipped rtx2080s-llama-3.2-1b profiles, from the same load
generator plan a real run would send. BurstGPT is its synthetic stand-in where the CSV
is absent (loadgen's burstgpt-synthetic). Prints one table per workload, saves JSON.

    python bench/study_simulated.py [--shapes tp,pp,dp,pd_always] [--qps 1,2,4,8,inf]
        [--workloads general,prefill-heavy,decode-heavy,T-general,T-prefill-heavy,T-decode-heavy]
        [--num-requests 200] [--out results/study_simulated]

Where the study gives a number (its section 4.1, QPS 8 on the BurstGPT subsets; "PD" is
every prompt prefilled remotely, pd_always here), the last table sets the simulated
figure beside it (``STUDY_NUMBERS``); ``--numbers`` runs only the cells those need.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
from rich.console import Console
from rich.table import Table

from deployments.launcher import REPO_ROOT
from loadgen.config import RunConfig, WorkloadConfig
from loadgen.study.simulate import SimulatedTarget, simulate_run

console = Console()
PROFILE = "rtx2080s-llama-3.2-1b"
SYNTHETIC_TRACE = "burstgpt-synthetic"


def cell(shape: str, workload: str, qps: float, args: argparse.Namespace) -> dict[str, Any]:
    trace = SYNTHETIC_TRACE if workload.startswith("T-") else "burstgpt"
    run = RunConfig(
        base_url="http://offline",
        workload=WorkloadConfig(name=workload, trace=trace),
        qps=qps,
        num_requests=args.num_requests,
        warmup_requests=0,
        seed=args.seed,
        show_progress=False,
    )
    result = asyncio.run(simulate_run(run, SimulatedTarget(shape, PROFILE), Console(quiet=True)))
    s, server = result.summary, result.server
    return {
        "shape": shape,
        "workload": workload,
        "qps": qps,
        "req_s": s.request_throughput,
        "tok_s": s.total_token_throughput,
        "output_tok_s": s.output_token_throughput,
        "ttft_p50_ms": s.ttft.p50 * 1000,
        "ttft_p90_ms": s.ttft.p90 * 1000,
        "ttft_p95_ms": s.ttft.p95 * 1000,
        "itl_mean_ms": s.itl.mean * 1000,
        "itl_p50_ms": s.itl.p50 * 1000,
        "itl_p90_ms": s.itl.p90 * 1000,
        "itl_p99_ms": s.itl.p99 * 1000,
        "gpu_util_pct": server.gpu_utilization_mean_pct,
        "gpu_imbalance_pct": server.gpu_imbalance_pct,
        "errors": s.errors + s.rejected,
    }


@dataclass(frozen=True)
class StudyNumber:
    """A figure the study states: of ``shape`` (or its ratio to ``against``'s) on
    ``workload`` at QPS 8, and, for a claim of order (lower, above a bound), whether the
    simulated figure keeps it (``holds``; None: a plain figure, compared by ratio)."""

    workload: str
    claim: str
    figure: str
    shape: str
    study: float
    holds: Callable[[float], bool] | None
    against: str | None = None
    unit: str = ""


STUDY_NUMBERS = (
    StudyNumber("T-general", "PD's TTFT p95", "ttft_p95_ms", "pd_always", 786.0, None, unit="ms"),
    StudyNumber(
        "T-general",
        "TP's TTFT p95 over PD's (about a quarter)",
        "ttft_p95_ms",
        "tp",
        0.25,
        lambda v: v < 1.0,
        against="pd_always",
    ),
    StudyNumber(
        "T-general",
        "TP's throughput over PD's (about 6% lower)",
        "req_s",
        "tp",
        0.94,
        lambda v: v < 1.0,
        against="pd_always",
    ),
    StudyNumber(
        "T-prefill-heavy",
        "PD's mean ITL (at most 10 ms)",
        "itl_mean_ms",
        "pd_always",
        10.0,
        lambda v: v <= 10.0,
        unit="ms",
    ),
    *(
        StudyNumber(
            "T-prefill-heavy",
            f"{shape.upper()}'s mean ITL (over 200 ms)",
            "itl_mean_ms",
            shape,
            200.0,
            lambda v: v > 200.0,
            unit="ms",
        )
        for shape in ("tp", "pp", "dp")
    ),
    StudyNumber(
        "T-prefill-heavy",
        "DP's GPU imbalance (up to 94%)",
        "gpu_imbalance_pct",
        "dp",
        94.0,
        lambda v: v >= 50.0,
        unit="%",
    ),
)
STUDY_QPS = 8.0


def print_numbers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The study's numbers beside the simulated ones, where the cells ran."""
    by_cell = {(r["shape"], r["workload"], r["qps"]): r for r in rows}
    table = Table(title="the study's numbers (QPS 8) against the simulation")
    for column in ("workload", "claim", "study", "simulated", "simulated / study", "order"):
        table.add_column(column, justify="left" if column in ("workload", "claim") else "right")
    compared = []
    for number in STUDY_NUMBERS:
        row = by_cell.get((number.shape, number.workload, STUDY_QPS))
        base = by_cell.get((number.against, number.workload, STUDY_QPS)) if number.against else {}
        if row is None or base is None or row[number.figure] is None:
            continue
        value = row[number.figure] / base[number.figure] if number.against else row[number.figure]
        holds = None if number.holds is None else number.holds(value)
        table.add_row(
            number.workload,
            number.claim,
            f"{number.study:g}{number.unit}",
            f"{value:.2f}{number.unit}" if number.against else f"{value:.1f}{number.unit}",
            f"{value / number.study:.2f}",
            "-" if holds is None else ("kept" if holds else "not kept"),
        )
        compared.append(
            {"claim": number.claim, "study": number.study, "simulated": value, "order": holds}
        )
    console.print(table)
    return compared


def print_tables(rows: list[dict[str, Any]], workloads: list[str]) -> None:
    columns = ("req_s", "tok_s", "ttft_p50_ms", "itl_p50_ms", "itl_p90_ms", "gpu_imbalance_pct")
    for workload in workloads:
        table = Table(title=f"{workload}: simulated 2x RTX 2080 SUPER, Llama-3.2-1B")
        for column in ("shape", "qps", *columns):
            table.add_column(column, justify="right")
        for row in rows:
            if row["workload"] == workload:
                values = [f"{row[c]:.1f}" if row[c] is not None else "-" for c in columns]
                table.add_row(row["shape"], f"{row['qps']:g}", *values)
        console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="tp,pp,dp,pd_always")
    parser.add_argument(
        "--workloads",
        default="general,prefill-heavy,decode-heavy,T-general,T-prefill-heavy,T-decode-heavy",
    )
    parser.add_argument("--qps", default="1,2,4,8,inf")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "study_simulated")
    parser.add_argument(
        "--numbers", action="store_true", help="only the cells the study's numbers need"
    )
    args = parser.parse_args()
    if args.numbers:
        args.workloads = ",".join(sorted({n.workload for n in STUDY_NUMBERS}))
        args.qps = f"{STUDY_QPS:g}"
    shapes, workloads = args.shapes.split(","), args.workloads.split(",")
    rates = [math.inf if q == "inf" else float(q) for q in args.qps.split(",")]
    started = time.perf_counter()
    rows = [
        cell(shape, workload, qps, args)
        for workload in workloads
        for shape in shapes
        for qps in rates
    ]
    print_tables(rows, workloads)
    compared = print_numbers(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "study_simulated.json"
    path.write_text(
        json.dumps({"profile": PROFILE, "rows": rows, "study_numbers": compared}, indent=1)
    )
    console.print(f"{len(rows)} cells in {time.perf_counter() - started:.0f} s; saved {path}")


if __name__ == "__main__":
    main()
