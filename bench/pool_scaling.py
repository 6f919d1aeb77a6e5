"""Does a pool that follows the load keep the SLOs at less cost? (benchmark, not a test)

One step of load (quiet, busy, quiet again) on three pools of the same auto
engines (deployments/auto_scaled.yaml), all run as engine replicas of their own:
  fixed-1   one engine throughout (the policy's upper line out of reach)
  fixed-2   two engines throughout
  scaled    one to two engines, as Ray Serve's autoscaling decides from the SLOs
For each phase: goodput and SLO attainment (the client's TTFT and TPOT objectives),
TTFT p50/p95 and ITL mean/p50; for the whole run: engine-seconds (the engines the
routers listed, sampled every second), which is what a pool that shrinks saves.
Measuring client at niceness 15, like Ray's workers (run it under `nice -n 15`).

    nice -n 15 python bench/pool_scaling.py [--only scaled,fixed-1,fixed-2] [--rounds 1]
        [--busy-rate 5]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import threading
import time
from pathlib import Path
from statistics import median
from typing import Any

import httpx
import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
import yaml
from rich.console import Console
from rich.table import Table

from deployments.launcher import DEPLOYMENTS_DIR, serve_run
from loadgen.config import RunConfig, WorkloadConfig
from loadgen.scheduling.runner import execute_run

console = Console(width=160)
SLO_TTFT_MS = 1000.0
SLO_TPOT_MS = 50.0
# (name, rate req/s, seconds): quiet, then more than one engine keeps within the SLOs
# (long enough for a second engine to start under load: about 95 s on this box), then
# quiet again for long enough to shrink (downscale delay, window, drain).
QUIET_RATE = 0.5
BUSY_RATE = 5.0  # --busy-rate: where one engine misses the SLOs depends on the box's day


def phases(busy_rate: float) -> tuple[tuple[str, float, float], ...]:
    return (
        ("quiet", QUIET_RATE, 40.0),
        ("busy", busy_rate, 240.0),
        ("quiet again", QUIET_RATE, 150.0),
    )


# The pool is sized for the client's objectives, and reacts faster than the shipped
# YAML's to fit the run.
SCALED = {
    "ttft_slo_s": SLO_TTFT_MS / 1000,
    "tpot_slo_s": SLO_TPOT_MS / 1000,
    "upscale_delay_s": 5,
    "downscale_delay_s": 30,
    "window_s": 10,
}


def variant(name: str) -> dict[str, Any]:
    document = yaml.safe_load((DEPLOYMENTS_DIR / "auto_scaled.yaml").read_text())
    pool = document["applications"][0]["args"]["pools"][0]
    scaling = pool["autoscaling"]
    scaling.update(SCALED)
    if name == "fixed-1":
        scaling["scale_up_at"] = 1e9  # never reached: one engine throughout
    elif name == "fixed-2":
        pool["replicas"] = scaling["min_replicas"] = scaling["max_replicas"] = 2
    return document


class EngineCounter:
    """Samples how many engines the router routes to, once a second."""

    def __init__(self, url: str) -> None:
        self._url = url
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> EngineCounter:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(1.0)

    def sample(self) -> None:
        try:
            replicas = httpx.get(f"{self._url}/health", timeout=5).json()["replicas"]
            self.samples.append((time.monotonic(), len(replicas)))
        except (httpx.HTTPError, ValueError, KeyError):
            pass

    def engine_seconds(self, start: float, end: float) -> float:
        inside = [(t, n) for t, n in self.samples if start <= t <= end]
        return sum(n * (later - t) for (t, n), (later, _) in itertools.pairwise(inside))

    def most(self, start: float, end: float) -> int:
        return max((n for t, n in self.samples if start <= t <= end), default=0)


def run_phases(
    url: str, seed: int, counter: EngineCounter, busy_rate: float
) -> list[dict[str, Any]]:
    rows = []
    for index, (phase, rate, seconds) in enumerate(phases(busy_rate)):
        run = RunConfig(
            base_url=url,
            workload=WorkloadConfig(name="mixed"),
            qps=rate,
            arrival_process="poisson",
            num_requests=max(1, round(rate * seconds)),
            seed=seed + index,
            slo_ttft_ms=SLO_TTFT_MS,
            slo_tpot_ms=SLO_TPOT_MS,
            show_progress=False,
        )
        started = time.monotonic()
        s = asyncio.run(execute_run(run, Console(quiet=True))).summary
        ended = time.monotonic()
        rows.append(
            {
                "phase": phase,
                "rate": rate,
                "goodput": s.goodput,
                "slo_attainment": s.slo_attainment,
                "ttft_p50_ms": s.ttft.p50 * 1000,
                "ttft_p95_ms": s.ttft.p95 * 1000,
                "itl_mean_ms": s.itl.mean * 1000,
                "itl_p50_ms": s.itl.p50 * 1000,
                "errors": s.errors + s.rejected,
                "engine_seconds": counter.engine_seconds(started, ended),
                "most_engines": counter.most(started, ended),
                "seconds": ended - started,
            }
        )
        console.print(
            f"  {phase} @ {rate:g} req/s: goodput {s.goodput:.2f},"
            f" SLO met {s.slo_attainment:.0%}, engines up to {rows[-1]['most_engines']}"
        )
    return rows


def measure(name: str, seed: int, folder: Path, busy_rate: float) -> dict[str, Any]:
    """One pool through the phases: each phase's figures, and the engine count over time
    (seconds since the first phase began). The serve log stays in ``folder``."""
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(variant(name)))
    with serve_run(str(path), log_dir=folder) as app, EngineCounter(app.base_url) as counter:
        began = time.monotonic()
        rows = run_phases(app.base_url, seed, counter, busy_rate)
    timeline = [(round(t - began, 1), n) for t, n in counter.samples if t >= began]
    changes = [p for i, p in enumerate(timeline) if i == 0 or p[1] != timeline[i - 1][1]]
    console.print(f"  engines over time (s, count): {changes}")
    return {"phases": rows, "engines_over_time": changes}


def print_table(results: dict[str, list[dict[str, Any]]], busy_rate: float) -> None:
    objective = f"TTFT <= {SLO_TTFT_MS:g} ms, TPOT <= {SLO_TPOT_MS:g} ms"
    table = Table(title=f"step load, medians over rounds ({objective})")
    columns = ("pool", "phase", "req/s", "goodput", "SLO met", "TTFT p50", "TTFT p95")
    for column in (*columns, "ITL mean", "ITL p50", "engines", "engine-s", "errors"):
        table.add_column(column, justify="right")
    for pool, rounds in results.items():
        for index, (phase, rate, _) in enumerate(phases(busy_rate)):
            rows = [r["phases"][index] for r in rounds]

            def mid(key: str, rows: list[dict[str, Any]] = rows) -> float:
                return median(r[key] for r in rows)

            table.add_row(
                pool,
                phase,
                f"{rate:g}",
                f"{mid('goodput'):.2f}",
                f"{mid('slo_attainment'):.0%}",
                f"{mid('ttft_p50_ms'):.0f} ms",
                f"{mid('ttft_p95_ms'):.0f} ms",
                f"{mid('itl_mean_ms'):.1f} ms",
                f"{mid('itl_p50_ms'):.1f} ms",
                f"{max(r['most_engines'] for r in rows)}",
                f"{mid('engine_seconds'):.0f}",
                f"{mid('errors'):.0f}",
            )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="scaled,fixed-1,fixed-2", help="pools to run")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, pools interleaved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--busy-rate", type=float, default=BUSY_RATE, help="req/s when busy")
    parser.add_argument("--out", type=Path, default=Path("results/pool_scaling"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pools = args.only.split(",")
    results: dict[str, list[dict[str, Any]]] = {pool: [] for pool in pools}
    for round_index in range(args.rounds):
        for pool in pools:
            console.rule(f"{pool}, round {round_index + 1}")
            folder = args.out / f"{pool}-{round_index + 1}"
            folder.mkdir(parents=True, exist_ok=True)
            results[pool].append(measure(pool, args.seed, folder, args.busy_rate))
    print_table(results, args.busy_rate)
    saved = args.out / "pool_scaling.json"
    saved.write_text(json.dumps({"phases": phases(args.busy_rate), "results": results}, indent=2))
    console.print(f"saved {saved}")


if __name__ == "__main__":
    main()
