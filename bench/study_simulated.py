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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
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
        "itl_p50_ms": s.itl.p50 * 1000,
        "itl_p90_ms": s.itl.p90 * 1000,
        "itl_p99_ms": s.itl.p99 * 1000,
        "gpu_util_pct": server.gpu_utilization_mean_pct,
        "gpu_imbalance_pct": server.gpu_imbalance_pct,
        "errors": s.errors + s.rejected,
    }


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
    args = parser.parse_args()
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
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "study_simulated.json"
    path.write_text(json.dumps({"profile": PROFILE, "rows": rows}, indent=1))
    console.print(f"{len(rows)} cells in {time.perf_counter() - started:.0f} s; saved {path}")


if __name__ == "__main__":
    main()
