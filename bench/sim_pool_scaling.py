"""Does a scaled pool of simulated GPU engines grow to 16 and back without losing a
request? (benchmark, not a test)

deployments/auto_scaled.yaml on simulated engines (``deployments.serve --simulate``:
each engine a Serve replica of its own, keeping an H100's time for Llama 3.1 8B,
stretched by ``--time-scale`` so that this box's router keeps up), its pool allowed
``--min-engines`` to ``--max-engines``. The load: busy for ``--busy-s`` (the pool grows
an engine at a time, each one started before the next), a light tail while it starts to
shrink (requests in flight on engines that drain), then idle until it is back at its
minimum. The client reports in the fleet's time (``engine_time_scale``).

The pool's TPOT objective is set just above the profile's lone-request decode step
(7.1 ms), so any steady traffic reads as pressure over the scale-up line and none as
room to shrink: an H100's decode step hardly grows with the batch, so the run tests
the mechanism (engines start, join the routers, drain and leave under load), not
where the line is (bench/pool_scaling.py does that on real engines).

Prints per phase: requests, errors, TTFT/ITL p50 and the engine count reached; the
engine count over time; resident memory per simulated engine process. Saves JSON.
Measuring client at niceness 15, like Ray's workers.

    nice -n 15 python bench/sim_pool_scaling.py [--max-engines 16] [--time-scale 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import psutil
import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
import yaml
from pool_scaling import EngineCounter
from rich.console import Console
from rich.table import Table

from deployments.launcher import APP_NAME, config_path, serve_run, simulated_config
from loadgen.config import RunConfig, WorkloadConfig
from loadgen.scheduling.runner import execute_run
from splitserve.processes import command_lines

console = Console(width=160)
PROFILE = "h100-llama-3.1-8b"
PROMPT_TOKENS, OUTPUT_TOKENS = 512, 128
TPOT_SLO_S = 0.0085  # the profile's lone decode step is 7.07 ms: 0.83 of this
TTFT_SLO_S = 2.0


def pool_config(args: argparse.Namespace, folder: Path) -> Path:
    copy = simulated_config(config_path("auto_scaled"), args.profile, args.time_scale)
    document = yaml.safe_load(copy.read_text())
    pool = document["applications"][0]["args"]["pools"][0]
    pool["replicas"] = args.min_engines
    pool.pop("cpu_binds", None)  # simulated engines compute nothing
    pool["autoscaling"].update(
        min_replicas=args.min_engines,
        max_replicas=args.max_engines,
        ttft_slo_s=TTFT_SLO_S,
        tpot_slo_s=TPOT_SLO_S,
        upscale_delay_s=3,
        downscale_delay_s=5,
        window_s=10,
        drain_timeout_s=120,
    )
    path = folder / "auto_scaled.simulated.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


class PoolWatcher(EngineCounter):
    """Once a second: how many engines the router routes to (``samples``), and the
    resident memory of the application's engine replica processes."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.memory: list[tuple[int, float]] = []  # (engine processes, mean MiB)

    @property
    def count(self) -> int:
        return self.samples[-1][1] if self.samples else 0

    def sample(self) -> None:
        super().sample()
        self.memory.append(_engine_memory())


def _engine_memory() -> tuple[int, float]:
    """Engine replica processes of the application and their mean resident MiB (the
    router's replica excluded)."""
    prefix = f"ray::ServeReplica:{APP_NAME}:"
    sizes = []
    for pid, line in command_lines().items():
        if line.startswith(prefix) and "Router" not in line:
            with contextlib.suppress(psutil.Error):  # it ended meanwhile
                sizes.append(psutil.Process(pid).memory_info().rss / 1024**2)
    return len(sizes), statistics.mean(sizes) if sizes else 0.0


def load_phase(url: str, rate: float, seconds: float, seed: int, scale: float) -> dict[str, Any]:
    run = RunConfig(
        base_url=url,
        workload=WorkloadConfig(name="custom", input_len=PROMPT_TOKENS, output_len=OUTPUT_TOKENS),
        qps=rate * scale,  # in the fleet's time: the client spreads arrivals by the scale
        arrival_process="poisson",
        num_requests=max(1, round(rate * seconds)),
        warmup_requests=0,
        seed=seed,
        engine_time_scale=scale,
        show_progress=False,
    )
    summary = asyncio.run(execute_run(run, Console(quiet=True))).summary
    return {
        "requests": summary.requests,
        "completed": summary.completed,
        "errors": summary.errors + summary.rejected,
        "ttft_p50_ms": summary.ttft.p50 * 1000,
        "itl_p50_ms": summary.itl.p50 * 1000,
    }


def run(args: argparse.Namespace, url: str, watcher: PoolWatcher) -> list[dict[str, Any]]:
    phases: list[dict[str, Any]] = []

    def record(phase: str, started: float, rows: list[dict[str, Any]]) -> None:
        reached = [n for t, n in watcher.samples if t >= started]
        phases.append(
            {
                "phase": phase,
                "seconds": time.monotonic() - started,
                "requests": sum(r["requests"] for r in rows),
                "completed": sum(r["completed"] for r in rows),
                "errors": sum(r["errors"] for r in rows),
                "ttft_p50_ms": statistics.median(r["ttft_p50_ms"] for r in rows) if rows else None,
                "itl_p50_ms": statistics.median(r["itl_p50_ms"] for r in rows) if rows else None,
                "engines_max": max(reached, default=watcher.count),
                "engines_min": min(reached, default=watcher.count),
            }
        )
        console.print(f"  {phase}: {phases[-1]}")

    # One run, not rounds: a pause between runs would read as room to shrink.
    started, seed = time.monotonic(), args.seed
    rows = [load_phase(url, args.busy_rate, args.busy_s, seed, args.time_scale)]
    record("busy", started, rows)
    started = time.monotonic()
    tail = load_phase(url, args.tail_rate, args.tail_s, seed + 1, args.time_scale)
    record("tail", started, [tail])
    started = time.monotonic()
    while watcher.count > args.min_engines and time.monotonic() - started < args.shrink_timeout_s:
        time.sleep(2)
    record("idle", started, [])
    return phases


def print_tables(phases: list[dict[str, Any]], memory: list[tuple[int, float]]) -> None:
    table = Table(title="simulated H100 pool, 2 -> 16 -> 2 (latencies in the fleet's time)")
    for column in ("phase", "s", "requests", "completed", "errors", "TTFT p50", "ITL p50"):
        table.add_column(column, justify="right")
    table.add_column("engines", justify="right")
    for p in phases:
        table.add_row(
            p["phase"],
            f"{p['seconds']:.0f}",
            str(p["requests"]),
            str(p["completed"]),
            str(p["errors"]),
            "-" if p["ttft_p50_ms"] is None else f"{p['ttft_p50_ms']:.1f} ms",
            "-" if p["itl_p50_ms"] is None else f"{p['itl_p50_ms']:.2f} ms",
            f"{p['engines_min']}..{p['engines_max']}",
        )
    console.print(table)
    most = max(memory, default=(0, 0.0))
    console.print(f"most engine processes at once: {most[0]}, {most[1]:.0f} MiB resident each")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default=PROFILE)
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--min-engines", type=int, default=2)
    parser.add_argument("--max-engines", type=int, default=16)
    parser.add_argument("--busy-rate", type=float, default=2.0, help="req/s, wall clock")
    parser.add_argument("--busy-s", type=float, default=360.0, help="long enough to grow")
    parser.add_argument("--tail-rate", type=float, default=0.3)
    parser.add_argument("--tail-s", type=float, default=40.0)
    parser.add_argument("--shrink-timeout-s", type=float, default=400.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/sim_pool_scaling"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = pool_config(args, args.out)
    with serve_run(str(path), log_dir=args.out) as app, PoolWatcher(app.base_url) as watcher:
        began = time.monotonic()
        phases = run(args, app.base_url, watcher)
    timeline = [(round(t - began, 1), n) for t, n in watcher.samples if t >= began]
    changes = [p for i, p in enumerate(timeline) if i == 0 or p[1] != timeline[i - 1][1]]
    console.print(f"engines over time (s, count): {changes}")
    print_tables(phases, watcher.memory)
    saved = args.out / "sim_pool_scaling.json"
    result = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "phases": phases,
        "engines_over_time": changes,
        "memory": max(watcher.memory, default=(0, 0.0)),
    }
    saved.write_text(json.dumps(result, indent=2))
    console.print(f"saved {saved}")


if __name__ == "__main__":
    main()
