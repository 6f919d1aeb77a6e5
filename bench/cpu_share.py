"""Where this box's CPU goes during one run, on real engines and on simulated ones
(benchmark, not a test).

A config is served on its vLLM engines, then on simulated engines that keep a fitted
profile's time (``engine.spend`` as given), and the same workload cell runs against
each. Every process's CPU time over the cell is read from /proc and summed by what the
process is: vLLM's compute worker (bound to the engine's cores), vLLM's engine core
(scheduling and messages, not bound), the simulated engines' CPU spenders, the router
(with the engines it hosts, where they run in its process), other Serve replicas, the
load generator, and Ray's own processes. What the simulation leaves out shows as a row
the real run has and the simulated one does not.

    python bench/cpu_share.py --profile results/sim_fidelity_cpu/cpu1-embedded-tp1-pp1.yaml
        [--config dp] [--workload general] [--rate 8] [--num-requests 60]
        [--spend cpu] [--out results/cpu_share.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import psutil
import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
from rich.console import Console
from rich.table import Table
from sim_fidelity import served

from deployments.launcher import REPO_ROOT, niced_like_ray_workers
from engines.simulated.cpu_spender import SPENDER_TAG
from loadgen.config import RunConfig, WorkloadConfig
from loadgen.scheduling.runner import execute_run

console = Console(width=140)
# (what a process is, a test on its name and command line), first match wins.
KINDS: list[tuple[str, Any]] = [
    ("vLLM worker (compute, bound)", lambda name, cmd: name.startswith("VLLM::Worker")),
    ("vLLM engine core (not bound)", lambda name, cmd: name.startswith("VLLM::EngineCor")),
    ("simulated engines' spenders", lambda name, cmd: SPENDER_TAG[:30] in cmd),
    ("router (and engines in it)", lambda name, cmd: ":Router" in cmd),
    ("other Serve replicas", lambda name, cmd: "ServeReplica" in cmd),
    ("load generator", lambda name, cmd: cmd.startswith(f"{os.getpid()}:")),
]
OTHER = "Ray and the rest"


def cpu_by_process() -> dict[int, tuple[str, float]]:
    """Every process's kind and CPU seconds so far."""
    found = {}
    for process in psutil.process_iter(["name", "cmdline", "cpu_times"]):
        name, cmdline, times = (process.info[k] for k in ("name", "cmdline", "cpu_times"))
        if name is None or cmdline is None or times is None:
            continue  # it ended meanwhile
        pid = process.pid
        command = f"{pid}:" if pid == os.getpid() else " ".join(cmdline)
        kind = next((k for k, test in KINDS if test(name, command)), OTHER)
        found[pid] = (kind, times.user + times.system)
    return found


def cpu_between(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    totals = dict.fromkeys([kind for kind, _ in KINDS] + [OTHER], 0.0)
    for pid, (kind, seconds) in after.items():
        totals[kind] += seconds - before.get(pid, (kind, 0.0))[1]
    return totals


def measured(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    with served(args.config, kind, args.profile.resolve(), args.spend) as app:
        run = RunConfig(
            base_url=app.base_url,
            workload=WorkloadConfig(name=args.workload),
            qps=args.rate,
            num_requests=args.num_requests,
            seed=args.seed,
            show_progress=False,
        )
        before = cpu_by_process()
        started = time.monotonic()
        with niced_like_ray_workers():
            result = asyncio.run(execute_run(run, Console(quiet=True)))
        wall = time.monotonic() - started
        cpu = cpu_between(before, cpu_by_process())
    summary = result.summary
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "ttft_p50_ms": summary.ttft.p50 * 1000,
        "itl_p50_ms": summary.itl.p50 * 1000,
        "output_tok_s": summary.output_token_throughput,
    }


def _share(run: dict[str, Any], process: str, cores: int) -> str:
    seconds = run["cpu_s"][process]
    return f"{seconds:.2f} s ({seconds / (cores * run['wall_s']):.0%})"


def print_table(runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    cores = os.cpu_count() or 1
    table = Table(
        title=f"CPU seconds over one cell ({args.config}, {args.workload} at {args.rate:g}"
        f" req/s, {args.num_requests} requests) and share of the box's {cores} cores;"
        " this box, no GPU"
    )
    table.add_column("process")
    for kind in runs:
        table.add_column(kind, justify="right")
    for process in runs["real"]["cpu_s"]:
        table.add_row(process, *(_share(run, process, cores) for run in runs.values()))
    table.add_row("all", *(f"{sum(run['cpu_s'].values()):.2f} s" for run in runs.values()))
    for metric in ("wall_s", "ttft_p50_ms", "itl_p50_ms", "output_tok_s"):
        table.add_row(metric, *(f"{run[metric]:.2f}" for run in runs.values()))
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, required=True, help="a fitted profile")
    parser.add_argument("--config", default="dp")
    parser.add_argument("--workload", default="general")
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--spend", choices=("wall", "cpu"), default="cpu")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "cpu_share.json")
    args = parser.parse_args()
    runs = {kind: measured(kind, args) for kind in ("real", "simulated")}
    print_table(runs, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    document = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}
    args.out.write_text(json.dumps(document, indent=1))
    console.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
