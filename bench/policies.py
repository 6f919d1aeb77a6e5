"""Which router policy gives the most goodput on a mixed workload? (benchmark, not a test)

Goodput as DistServe defines it (../shared/reference/002): requests per second that
meet both the TTFT and the TPOT objective. Same two-engine budget for every policy:
  dp           deployments/dp.yaml         two replicas, round-robin (the study's DP)
  pd-always    deployments/pd_always.yaml  every prompt prefilled remotely (the study's PD)
  pd-cond      deployments/pd.yaml         the conditional prefill policy, prefix-aware
  auto         deployments/auto.yaml       dp.yaml's engines without roles: the cost policy
                                           picks local or remote prefill per request
The workload is the load generator's `mixed` one (70% 128/128 chat turns, 30% 2048/32
documents) with bursty gamma arrivals, at rising rates. Prints a table, saves JSON
and a plot of goodput against rate.

    python bench/policies.py [--rates 2,4,8,12,16,20] [--num-requests 80] [--out results/policies]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
from rich.console import Console
from rich.table import Table

from deployments.launcher import serve_run
from loadgen.config import RunConfig, WorkloadConfig
from loadgen.scheduling.runner import execute_run

console = Console()
POLICIES = {"dp": "dp", "pd-always": "pd_always", "pd-cond": "pd", "auto": "auto"}
# The tiny model on two cores; pd.yaml's QoS defends the same TTFT.
SLO_TTFT_MS = 1000.0
SLO_TPOT_MS = 50.0
BURSTINESS = 0.5  # gamma shape: gaps twice as variable as Poisson


def measure(config: str, rates: list[float], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with serve_run(config) as app:
        for index, rate in enumerate(rates):
            run = RunConfig(
                base_url=app.base_url,
                workload=WorkloadConfig(name="mixed"),
                qps=rate,
                arrival_process="gamma",
                burstiness=BURSTINESS,
                num_requests=args.num_requests,
                # Fresh prompts at every rate: a rate that resent the previous rate's
                # documents found them in the decode replica's prefix cache, and the
                # conditional policy rightly kept them local (3 of 24 remote at 2 req/s).
                seed=args.seed + index,
                slo_ttft_ms=args.slo_ttft_ms,
                slo_tpot_ms=args.slo_tpot_ms,
                show_progress=False,
            )
            result = asyncio.run(execute_run(run, Console(quiet=True)))
            s = result.summary
            rows.append(
                {
                    "rate": rate,
                    "goodput": s.goodput,
                    "slo_attainment": s.slo_attainment,
                    "throughput": s.request_throughput,
                    "ttft_p50_ms": s.ttft.p50 * 1000,
                    "ttft_p95_ms": s.ttft.p95 * 1000,
                    "tpot_p50_ms": s.tpot.p50 * 1000,
                    # The mean cannot see tokens that arrive in clumps; the median can.
                    "itl_mean_ms": s.itl.mean * 1000,
                    "itl_p50_ms": s.itl.p50 * 1000,
                    "errors": s.errors + s.rejected,
                    "prefill_local": result.server.prefill_local,
                    "prefill_remote": result.server.prefill_remote,
                }
            )
            console.print(f"  {config} @ {rate:g} req/s: goodput {s.goodput:.2f}")
    return rows


def print_table(results: dict[str, list[dict[str, Any]]]) -> None:
    table = Table(title=f"goodput (TTFT <= {SLO_TTFT_MS:g} ms and TPOT <= {SLO_TPOT_MS:g} ms)")
    for column in ("policy", "rate", "goodput", "SLO met", "req/s", "TTFT p50", "TTFT p95"):
        table.add_column(column, justify="right")
    for column in ("TPOT p50", "ITL mean / p50"):
        table.add_column(column, justify="right")
    table.add_column("remote/local", justify="right")
    for policy, rows in results.items():
        for row in rows:
            table.add_row(
                policy,
                f"{row['rate']:g}",
                f"{row['goodput']:.2f}",
                f"{row['slo_attainment']:.0%}",
                f"{row['throughput']:.2f}",
                f"{row['ttft_p50_ms']:.0f} ms",
                f"{row['ttft_p95_ms']:.0f} ms",
                f"{row['tpot_p50_ms']:.1f} ms",
                f"{row['itl_mean_ms']:.1f} / {row['itl_p50_ms']:.1f} ms",
                f"{row['prefill_remote']:.0f}/{row['prefill_local']:.0f}",
            )
    console.print(table)


def plot(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for policy, rows in results.items():
        axis.plot([r["rate"] for r in rows], [r["goodput"] for r in rows], marker="o", label=policy)
    axis.set_xlabel("offered rate (req/s, gamma arrivals)")
    axis.set_ylabel("goodput (req/s within both SLOs)")
    axis.set_title("mixed workload, two engines")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="2,4,8,12,16,20")
    parser.add_argument("--num-requests", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float, default=SLO_TTFT_MS)
    parser.add_argument("--slo-tpot-ms", type=float, default=SLO_TPOT_MS)
    parser.add_argument("--only", default=",".join(POLICIES), help="policies to run")
    parser.add_argument("--out", type=Path, default=Path("results/policies"))
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for policy in args.only.split(","):
        console.rule(f"{policy} ({POLICIES[policy]}.yaml)")
        results[policy] = measure(POLICIES[policy], rates, args)
    print_table(results)
    (args.out / "policies.json").write_text(json.dumps(results, indent=2, default=str))
    plot(results, args.out / "goodput.png")
    console.print(f"saved {args.out / 'policies.json'} and {args.out / 'goodput.png'}")


if __name__ == "__main__":
    main()
