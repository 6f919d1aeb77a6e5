"""Does one box run a 64-engine fleet behind two routers, end to end, and what does each
engine cost in memory? (benchmark, not a test)

A shipped YAML (``--config``, auto.yaml by default: an auto pool, the router's
prefill policy, simulated KV hand-overs, the prefix index from KV events) on simulated
engines keeping an H100's time for Llama 3.1 8B, stretched by ``--time-scale``. The pool
has ``--engines`` engines, ``--per-process`` of them to a Serve replica's process
(``pools[].engines_per_process``), behind ``--routers`` router replicas, each on its own
port. One load generator per router offers half the load (``--rate`` in wall-clock
req/s; the fleet sees ``rate x time_scale``) for ``--seconds``.

Prints per router: requests, completed, errors, TTFT and ITL p50 in the fleet's time;
how many engines each router sent requests to, and the spread of requests over engines;
memory: proportional (PSS) and private memory of the engine processes, per engine, and
of the routers. Saves JSON. Measuring clients at niceness 15, like Ray's workers.

    nice -n 15 python bench/sim_fleet.py [--engines 64] [--per-process 8] [--routers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
import yaml
from rich.console import Console
from rich.table import Table

from deployments.launcher import (
    APP_NAME,
    ROUTER_DEPLOYMENT,
    config_path,
    serve_run,
    simulated_config,
)
from loadgen.client.server_view import parse_metrics
from loadgen.config import RunConfig, WorkloadConfig
from loadgen.scheduling.runner import execute_run
from splitserve.processes import command_lines

MIB = 1024**2
console = Console(width=160)
PROFILE = "h100-llama-3.1-8b"
PROMPT_TOKENS, OUTPUT_TOKENS = 512, 128
# Ray's CPU share of each simulated engine: its steps are timers, and 64 engines must
# fit the two CPUs a local cluster offers beside the routers.
ENGINE_NUM_CPUS = 0.01
REPLICA_REQUESTS = "splitserve_replica_requests_total"


def fleet_config(args: argparse.Namespace, folder: Path) -> Path:
    copy = simulated_config(config_path(args.config), args.profile, args.time_scale)
    document = yaml.safe_load(copy.read_text())
    application = document["applications"][0]
    fleet_args = application["args"]
    pool = fleet_args["pools"][0]
    pool.pop("cpu_binds", None)  # simulated engines compute nothing
    pool.update(replicas=args.engines, engines_per_process=args.per_process)
    fleet_args["pools"] = [pool]
    fleet_args.setdefault("router", {})["engine_in_router"] = False
    fleet_args.setdefault("resources", {})["engine_num_cpus"] = ENGINE_NUM_CPUS
    application["deployments"] = [{"name": ROUTER_DEPLOYMENT, "num_replicas": args.routers}]
    path = folder / f"{args.config}.fleet.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


async def load(url: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rate = args.rate / args.routers
    run = RunConfig(
        base_url=url,
        workload=WorkloadConfig(name="custom", input_len=PROMPT_TOKENS, output_len=OUTPUT_TOKENS),
        qps=rate * args.time_scale,  # in the fleet's time: the client spreads arrivals by it
        arrival_process="poisson",
        num_requests=max(1, round(rate * args.seconds)),
        warmup_requests=0,
        seed=seed,
        engine_time_scale=args.time_scale,
        show_progress=False,
    )
    summary = (await execute_run(run, Console(quiet=True))).summary
    return {
        "router": url,
        "requests": summary.requests,
        "completed": summary.completed,
        "errors": summary.errors + summary.rejected,
        "ttft_p50_ms": summary.ttft.p50 * 1000,
        "ttft_p90_ms": summary.ttft.p90 * 1000,
        "itl_p50_ms": summary.itl.p50 * 1000,
        "output_tokens_per_s": summary.output_token_throughput,
    }


async def load_every_router(urls: tuple[str, ...], args: argparse.Namespace) -> list[dict]:
    return list(
        await asyncio.gather(*(load(url, args, args.seed + i) for i, url in enumerate(urls)))
    )


def requests_by_engine(url: str) -> dict[str, float]:
    samples = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
    return {labels["replica"]: value for labels, value in samples.get(REPLICA_REQUESTS, [])}


def _rollup_mib(pid: int) -> dict[str, float]:
    """Proportional and private memory of a process (shared libraries split by PSS)."""
    memory = psutil.Process(pid).memory_full_info()
    return {
        "pss": memory.pss / MIB,
        "private": memory.uss / MIB,
        "rss": memory.rss / MIB,
    }


def memory(engines: int) -> dict[str, Any]:
    groups: list[dict[str, float]] = []
    routers: list[dict[str, float]] = []
    for pid, line in command_lines().items():
        if not line.startswith(f"ray::ServeReplica:{APP_NAME}:"):
            continue
        try:
            sizes = _rollup_mib(pid)
        except (OSError, KeyError):
            continue
        (routers if ROUTER_DEPLOYMENT in line else groups).append(sizes)
    return {
        "engine_processes": len(groups),
        "engine_pss_mib_total": sum(g["pss"] for g in groups),
        "engine_private_mib_total": sum(g["private"] for g in groups),
        "pss_mib_per_engine": sum(g["pss"] for g in groups) / max(1, engines),
        "private_mib_per_engine": sum(g["private"] for g in groups) / max(1, engines),
        "rss_mib_per_process": statistics.mean(g["rss"] for g in groups) if groups else 0.0,
        "router_pss_mib": [round(r["pss"]) for r in routers],
    }


def print_tables(result: dict[str, Any]) -> None:
    args = result["args"]
    table = Table(
        title=f"{args['engines']} simulated H100 engines ({args['per_process']} per process),"
        f" {args['routers']} routers, {args['config']} (latencies in the fleet's time)"
    )
    for column in ("router", "requests", "completed", "errors", "TTFT p50", "TTFT p90"):
        table.add_column(column, justify="right")
    table.add_column("ITL p50", justify="right")
    table.add_column("engines used", justify="right")
    for row, used in zip(result["routers"], result["engines_used_by_router"], strict=True):
        table.add_row(
            row["router"],
            str(row["requests"]),
            str(row["completed"]),
            str(row["errors"]),
            f"{row['ttft_p50_ms']:.1f} ms",
            f"{row['ttft_p90_ms']:.1f} ms",
            f"{row['itl_p50_ms']:.2f} ms",
            str(used),
        )
    console.print(table)
    spread = result["requests_per_engine"]
    console.print(
        f"requests per engine (both routers): min {spread['min']:.0f}, median"
        f" {spread['median']:.0f}, max {spread['max']:.0f}; engines never used:"
        f" {spread['unused']}"
    )
    mem = result["memory"]
    console.print(
        f"memory: {mem['engine_processes']} engine processes, per engine"
        f" {mem['pss_mib_per_engine']:.0f} MiB PSS, {mem['private_mib_per_engine']:.0f} MiB"
        f" private (total {mem['engine_pss_mib_total'] / 1024:.1f} GiB PSS); routers"
        f" {mem['router_pss_mib']} MiB PSS; engines up in {result['start_s']:.0f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="auto")
    parser.add_argument("--profile", default=PROFILE)
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--per-process", type=int, default=8)
    parser.add_argument("--routers", type=int, default=2)
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=4.0, help="req/s, wall clock, in all")
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/sim_fleet"))
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    path = fleet_config(args, args.out)
    started = time.monotonic()
    with serve_run(str(path), log_dir=args.out, ready_timeout_s=900) as app:
        start_s = time.monotonic() - started
        urls = app.router_urls or (app.base_url,)
        before = [requests_by_engine(url) for url in urls]
        rows = asyncio.run(load_every_router(urls, args))
        after = [requests_by_engine(url) for url in urls]
        mem = memory(args.engines)
    sent = [
        {name: count - old.get(name, 0.0) for name, count in new.items()}
        for old, new in zip(before, after, strict=True)
    ]
    engines = {f"engine-{index}" for index in range(args.engines)}
    total = {name: sum(router.get(name, 0.0) for router in sent) for name in engines}
    counts = sorted(total.values())
    result = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "start_s": start_s,
        "routers": rows,
        "engines_used_by_router": [sum(1 for c in router.values() if c > 0) for router in sent],
        "requests_per_engine": {
            "min": counts[0],
            "median": statistics.median(counts),
            "max": counts[-1],
            "unused": sum(1 for c in counts if c == 0),
        },
        "memory": mem,
    }
    print_tables(result)
    saved = args.out / f"sim_fleet_{args.engines}.json"
    saved.write_text(json.dumps(result, indent=2))
    console.print(f"saved {saved}")


if __name__ == "__main__":
    main()
