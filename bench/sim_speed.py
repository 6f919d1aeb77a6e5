"""How much faster than real time is the offline simulation? (benchmark, not a test)

dp.yaml's router (least-loaded replica choice) over N simulated engines on one
profile, each engine offered the same request rate of 1024-token prompts and 128-token
answers, in virtual time (deployments/simulate.py, in this process). Prints virtual
seconds served per wall second, events and the median TTFT per engine count; saves JSON.

    python bench/sim_speed.py [--engines 2,8,64] [--rate-per-engine 5] [--seconds 20]
        [--profile h100-llama-3.1-8b] [--out results/sim_speed]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
import yaml
from rich.console import Console
from rich.table import Table

from deployments.launcher import REPO_ROOT
from deployments.simulate import OfflineCluster, simulated_application
from splitserve.offline_exchange import Arrival

console = Console()
PROMPT_TOKENS, OUTPUT_TOKENS = 1024, 128


def config_with(engines: int, folder: Path) -> Path:
    document = yaml.safe_load((REPO_ROOT / "deployments" / "dp.yaml").read_text())
    args = document["applications"][0]["args"]
    args["pools"] = [{"role": "mixed", "replicas": engines}]
    args["router"] = {"replica_choice": "least_loaded"}
    path = folder / f"dp{engines}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def arrivals(count: int, rate: float, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    at, out = 0.0, []
    for index in range(count):
        at += rng.expovariate(rate)
        prompt = [rng.randint(10, 250) for _ in range(PROMPT_TOKENS)]
        out.append(Arrival(index, at, prompt, OUTPUT_TOKENS))
    return out


def measure(engines: int, args: argparse.Namespace) -> dict[str, Any]:
    config = simulated_application(str(config_with(engines, args.out)), args.profile)
    rate = args.rate_per_engine * engines
    requests = arrivals(int(rate * args.seconds), rate, args.seed)
    cluster = OfflineCluster(config)
    started = time.perf_counter()
    outcomes = cluster.run(requests)
    wall = time.perf_counter() - started
    virtual = cluster.queue.now - cluster.epoch  # from the first arrival's clock
    ttft = [o.token_times[0] - o.arrival_s for o in outcomes if o.token_times]
    return {
        "engines": engines,
        "requests": len(requests),
        "rate": rate,
        "virtual_s": virtual,
        "wall_s": wall,
        "speedup": virtual / wall,
        "events": cluster.queue.events,
        "ttft_p50_ms": 1000 * statistics.median(ttft),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="2,8,64")
    parser.add_argument("--rate-per-engine", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--profile", default="h100-llama-3.1-8b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "sim_speed")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [measure(int(n), args) for n in args.engines.split(",")]
    table = Table(title=f"offline simulation speed, {args.profile}, this box (2 cores)")
    for column in (
        "engines",
        "req/s",
        "requests",
        "virtual s",
        "wall s",
        "x real time",
        "events",
        "TTFT p50 ms",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["engines"]),
            f"{row['rate']:g}",
            str(row["requests"]),
            f"{row['virtual_s']:.1f}",
            f"{row['wall_s']:.2f}",
            f"{row['speedup']:.1f}",
            str(row["events"]),
            f"{row['ttft_p50_ms']:.1f}",
        )
    console.print(table)
    path = args.out / "sim_speed.json"
    path.write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1)
    )
    console.print(f"saved {path}")


if __name__ == "__main__":
    main()
