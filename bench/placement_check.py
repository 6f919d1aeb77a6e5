"""Does the advisor's placement serve in real time what its offline search promised?
(benchmark, not a test)

The YAML ``python -m loadgen advise --simulate PROFILE --devices N`` wrote (``--yaml``)
is served on simulated engines keeping the profile's time, stretched by
``--time-scale`` so that this box's router keeps up (each pool's engines in one process,
apart from the router). At each ``--rates`` (the fleet's req/s: the knee the search
found, and above it) the load generator runs the workload against it in real time, and
the same requests are served offline in virtual time (``python -m loadgen simulate``).
Prints, per rate, the share of requests that met the objectives and the TTFT and TPOT
p50 of both (in the fleet's time); saves JSON. Measuring client at niceness 15.

    nice -n 15 python bench/placement_check.py --yaml results/placement/summarize-8xh100.yaml \
        --input-len 1800 --output-len 24 --slo-ttft-ms 250 --slo-tpot-ms 20 --rates 150,180
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
import yaml
from rich.console import Console
from rich.table import Table

from deployments.launcher import ROUTER_DEPLOYMENT, serve_run, simulated_config
from loadgen.config import RunConfig, WorkloadConfig
from loadgen.scheduling.runner import RunResult, execute_run
from loadgen.study.simulate import SimulatedTarget, simulate_run

console = Console(width=150)
# Ray's CPU share of each simulated engine: its steps are timers.
ENGINE_NUM_CPUS = 0.01


def real_time_config(args: argparse.Namespace) -> Path:
    """The advised YAML on simulated engines, each pool in one process, router apart."""
    copy = simulated_config(args.yaml.resolve(), args.profile, args.time_scale)
    document = yaml.safe_load(copy.read_text())
    application = document["applications"][0]
    served = application["args"]
    for pool in served["pools"]:
        pool["engines_per_process"] = pool.get("replicas", 1)
    served.setdefault("router", {})["engine_in_router"] = False
    served.setdefault("resources", {})["engine_num_cpus"] = ENGINE_NUM_CPUS
    application["deployments"] = [{"name": ROUTER_DEPLOYMENT, "num_replicas": 1}]
    path = args.out / f"{args.yaml.stem}.real-time.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def run_config(args: argparse.Namespace, rate: float, base_url: str | None = None) -> RunConfig:
    extra = {"base_url": base_url, "engine_time_scale": args.time_scale} if base_url else {}
    return RunConfig(
        workload=WorkloadConfig(
            name="custom", input_len=args.input_len, output_len=args.output_len
        ),
        qps=rate,  # the fleet's: a real-time client spreads arrivals by the time scale
        num_requests=args.num_requests,
        warmup_requests=0,
        seed=args.seed,
        show_progress=False,
        server_metrics=False,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        **extra,
    )


def row(result: RunResult) -> dict[str, Any]:
    summary = result.summary
    return {
        "attainment": summary.slo_attainment,
        "goodput": summary.goodput,
        "ttft_p50_ms": summary.ttft.p50 * 1000,
        "tpot_p50_ms": summary.tpot.p50 * 1000,
        "completed": summary.completed,
        "errors": summary.errors + summary.rejected,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--yaml", type=Path, required=True, help="the advised YAML")
    parser.add_argument("--profile", default="h100-llama-3.1-8b")
    parser.add_argument("--input-len", type=int, required=True)
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--slo-ttft-ms", type=float, required=True)
    parser.add_argument("--slo-tpot-ms", type=float, required=True)
    parser.add_argument("--rates", required=True, help="the fleet's req/s, comma-separated")
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/placement_check"))
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    rates = [float(rate) for rate in args.rates.split(",")]
    quiet = Console(quiet=True)
    offline = {}
    for rate in rates:
        target = SimulatedTarget(str(args.yaml.resolve()), args.profile)
        offline[rate] = row(asyncio.run(simulate_run(run_config(args, rate), target, quiet)))
    real = {}
    with serve_run(str(real_time_config(args)), log_dir=args.out, ready_timeout_s=900) as app:
        for rate in rates:
            result = asyncio.run(execute_run(run_config(args, rate, app.base_url), quiet))
            real[rate] = row(result)
    table = Table(title=f"{args.yaml.name}: real time (x{args.time_scale:g}) against offline")
    for column in ("req/s", "met real", "met offline", "TTFT p50 ms", "TPOT p50 ms", "errors"):
        table.add_column(column, justify="right")
    for rate in rates:
        live, virtual = real[rate], offline[rate]
        table.add_row(
            f"{rate:g}",
            f"{live['attainment']:.1%}",
            f"{virtual['attainment']:.1%}",
            f"{live['ttft_p50_ms']:.1f} / {virtual['ttft_p50_ms']:.1f}",
            f"{live['tpot_p50_ms']:.2f} / {virtual['tpot_p50_ms']:.2f}",
            f"{live['errors']} / {virtual['errors']}",
        )
    console.print(table)
    saved = args.out / f"{args.yaml.stem}.json"
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "real": real, "offline": offline}
    saved.write_text(json.dumps(report, indent=2))
    console.print(f"saved {saved}")


if __name__ == "__main__":
    main()
