"""The step-level ruler: a latency model judged on real engine steps it was not fitted on
(benchmark, not a test).

single.yaml's real vLLM engine logs every step it runs (``engine.step_log``,
engines/step_log.py: its prefill tokens and sequences, query-key pairs, decode
sequences and context, and its duration). Each cell (a workload at a rate) is run in
every round, rounds interleaved; the steps of the first round are the calibration set
and the steps of the others are held out. The latency profile's own step formula
(splitserve/latency/profile.py ``step_seconds``) is fitted on the calibration steps by
non-negative least squares on relative error, and its error is printed per batch-shape
bucket of the held-out steps: median |predicted / measured - 1|. A step's time here is
the engine core's ``step`` (schedule, forward pass, sampling, output): no HTTP path, no
client, no time between requests, which is what resolves on a box whose end-to-end
figures move tens of percent between minutes. ``--profile`` judges a profile as well
(e.g. the one ``python -m loadgen profile`` fitted over HTTP for bench/sim_fidelity.py).

The scheduler replay: each held-out run is served again offline (deployments/simulate.py,
single.yaml's router and the simulated scheduler) with every step taking what the real
step that started then took, each request arriving when the real engine core took it
in (the step log's request records). Then each request's simulated TTFT and last-token
time, from that arrival, are set beside the engine core's (median |error| per
request): what is left is the scheduler model's, not the latency model's, the HTTP
path's or the box's. The engine's records and the client's requests are on one clock
(``time.perf_counter``, CLOCK_MONOTONIC, is the host's), so each run's are lined up.

    python bench/step_ruler.py [--workloads general,prefill-heavy,decode-heavy]
        [--rates 2,8] [--rounds 2] [--num-requests 40] [--profile FILE]
        [--runs results/step_ruler/runs.json] [--out results/step_ruler]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import random
import shutil
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import psutil
import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
import yaml
from rich.console import Console
from rich.table import Table
from sim_fidelity import zero_profile

from deployments.launcher import config_path, niced_like_ray_workers, serve_run
from deployments.simulate import EventQueue, OfflineCluster, simulated_application
from engines.step_log import LogRecord, RequestRecord, StepRecord, read_log
from loadgen.config import RunConfig, WorkloadConfig
from loadgen.outputs.stats import RequestMetrics
from loadgen.scheduling.runner import execute_run
from splitserve.latency.fit import nonnegative_least_squares
from splitserve.latency.profile import LatencyProfile, StepShape, StepTimes, load_profile
from splitserve.offline_exchange import Arrival

console = Console()
# The profile's linear terms, in the order of a step's features (``features``).
TERMS = (
    "step_overhead_s",
    "compute_per_token_s",
    "per_sequence_s",
    "per_context_token_s",
    "per_attention_pair_s",
)
TARGET = 0.05  # the bar: median |error| per bucket on held-out steps
REPLAY_TARGET = 0.03  # and per request, for the scheduler replay
# Batch-shape buckets: what a step computes, by its kind and size.
DECODE_BUCKETS = ((1, 1), (2, 4), (5, 16), (17, 64), (65, 1 << 30))
PREFILL_BUCKETS = ((1, 128), (129, 512), (513, 2048), (2049, 1 << 30))


def shape_of(step: StepRecord) -> StepShape:
    return StepShape(
        prefill_tokens=step.prefill_tokens,
        attention_pairs=step.attention_pairs,
        prefill_seqs=step.prefill_seqs,
        decode_seqs=step.decode_seqs,
        decode_context_tokens=step.decode_context_tokens,
    )


def features(step: StepRecord) -> list[float]:
    """The step's multipliers of TERMS in ``LatencyProfile.step_seconds`` (its linear
    part taken as compute-bound: the embedded model's weights are read in microseconds)."""
    return [
        1.0,
        float(step.prefill_tokens + step.decode_seqs),
        float(step.prefill_seqs + step.decode_seqs),
        float(step.decode_context_tokens),
        float(step.attention_pairs),
    ]


def bucket(step: StepRecord) -> str:
    if step.prefill_tokens and step.decode_seqs:
        return "mixed"
    ranges, size, kind = (
        (PREFILL_BUCKETS, step.prefill_tokens, "prefill tokens")
        if step.prefill_tokens
        else (DECODE_BUCKETS, step.decode_seqs, "decode seqs")
    )
    low, high = next((lo, hi) for lo, hi in ranges if lo <= size <= hi)
    return f"{kind} {low}+" if high >= 1 << 30 else f"{kind} {low}-{high}"


def fit(steps: Sequence[StepRecord]) -> dict[str, float]:
    """TERMS by non-negative least squares on relative error over ``steps``."""
    rows = np.array([features(step) for step in steps])
    seconds = np.array([step.seconds for step in steps])
    weights = 1.0 / seconds
    solution = nonnegative_least_squares(rows * weights[:, None], seconds * weights)
    return dict(zip(TERMS, (float(value) for value in solution), strict=True))


def fitted_seconds(terms: dict[str, float]) -> Callable[[StepRecord], float]:
    coefficients = [terms[name] for name in TERMS]
    return lambda step: float(np.dot(coefficients, features(step)))


def profile_seconds(profile: LatencyProfile) -> Callable[[StepRecord], float]:
    return lambda step: profile.step_seconds(shape_of(step))


def errors(
    steps: Sequence[StepRecord], predict: Callable[[StepRecord], float]
) -> dict[str, dict[str, float]]:
    """Per bucket (and ``all``): the steps and the median and p90 |predicted/measured-1|."""
    by_bucket: dict[str, list[float]] = {}
    for step in steps:
        error = abs(predict(step) / step.seconds - 1)
        by_bucket.setdefault(bucket(step), []).append(error)
        by_bucket.setdefault("all", []).append(error)
    return {
        name: {
            "steps": len(values),
            "median": statistics.median(values),
            "p90": float(np.percentile(values, 90)),
        }
        for name, values in sorted(by_bucket.items(), key=lambda item: _order(item[0]))
    }


def _order(name: str) -> tuple[int, int]:
    kinds = ("prefill tokens", "decode seqs", "mixed", "all")
    kind = next(index for index, prefix in enumerate(kinds) if name.startswith(prefix))
    digits = "".join(ch for ch in name.split(" ")[-1].split("-")[0] if ch.isdigit())
    return kind, int(digits or 0)


def logging_config(out: Path, engine_core: int | None) -> Path:
    """single.yaml with its engine logging steps under ``out``/steps (and bound to
    ``engine_core``, where given)."""
    document = yaml.safe_load(config_path("single").read_text())
    args = document["applications"][0]["args"]
    args["engine"] = {**args.get("engine", {}), "step_log": str((out / "steps").resolve())}
    if engine_core is not None:
        args["pools"][0]["cpu_binds"] = [str(engine_core)]
    path = out / "single-step-log.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


@dataclass
class ServedRun:
    """One run on the real engine: its requests as the client saw them (seconds from
    the run's start), and the engine core's steps and requests while it ran (their
    times from the same start)."""

    round: int
    workload: str
    rate: float
    requests: list[dict[str, Any]]
    steps: list[StepRecord]
    engine_requests: list[RequestRecord]


def collect(args: argparse.Namespace) -> list[ServedRun]:
    """Every cell once a round, rounds in turn, on one started engine."""
    cells = [(w, r) for w in args.workloads.split(",") for r in map(float, args.rates.split(","))]
    runs: list[ServedRun] = []
    shutil.rmtree(args.out / "steps", ignore_errors=True)  # this run's logs only
    if args.engine_core is not None:
        # The client keeps off the engine's core (the router's processes are Ray's).
        others = [core for core in range(psutil.cpu_count() or 1) if core != args.engine_core]
        psutil.Process().cpu_affinity(others or None)
    with serve_run(str(logging_config(args.out, args.engine_core))) as app:
        logs = args.out / "steps"
        for round_index in range(args.rounds):
            for cell, (workload, rate) in enumerate(cells):
                # Where each log ends now: the run's records are what follows (the
                # engine is idle between runs, so no line is half written).
                before = {log: log.stat().st_size for log in logs.glob("*.jsonl")}
                run = RunConfig(
                    base_url=app.base_url,
                    workload=WorkloadConfig(name=workload),
                    qps=rate,
                    num_requests=args.num_requests,
                    # Fresh prompts every run: no run finds another's in the prefix cache.
                    seed=args.seed + 100 * round_index + cell,
                    show_progress=False,
                )
                with niced_like_ray_workers():
                    result = asyncio.run(execute_run(run, Console(quiet=True)))
                records = [
                    _from_run_start(record, result.clock_origin_s)
                    for log in logs.glob("*.jsonl")
                    for record in read_log(log, before.get(log, 0))
                ]
                steps = [r for r in records if isinstance(r, StepRecord)]
                engine_requests = [r for r in records if isinstance(r, RequestRecord)]
                requests = [_request(m) for m in result.requests if m.outcome == "ok"]
                runs.append(
                    ServedRun(round_index, workload, rate, requests, steps, engine_requests)
                )
                console.print(
                    f"round {round_index + 1}, {workload} at {rate:g}/s: {len(steps)} steps,"
                    f" {len(requests)} requests"
                )
    return runs


def _from_run_start(record: LogRecord, origin: float) -> LogRecord:
    if isinstance(record, StepRecord):
        return msgspec.structs.replace(record, started=record.started - origin)
    return msgspec.structs.replace(
        record,
        arrived=record.arrived - origin,
        first_token=record.first_token - origin,
        last_token=record.last_token - origin,
    )


def _request(metrics: RequestMetrics) -> dict[str, Any]:
    return {
        "sent_s": metrics.sent_s,
        "ttft_s": metrics.ttft_s,
        "e2e_s": metrics.e2e_s,
        "prompt_tokens": metrics.input_tokens,
        "output_tokens": metrics.output_tokens,
    }


# ---- the scheduler replay ------------------------------------------------------------

# A step that starts within this of the last one's end followed it back to back: its
# gap is the engine core's own work between steps, part of the step's cycle.
BACK_TO_BACK_S = 0.002


class MeasuredSteps(StepTimes):
    """A simulated engine's steps on the real run's clock: a step ends where the real
    step that started nearest it was followed by the next (its duration and the engine
    core's gap after it, ``between``, where they ran back to back), so that what the
    replay can get wrong is only which requests each step computes, the scheduler
    model's part; one that starts too late for that takes the real one's cycle. Its
    tokens therefore come ``between`` after the real ones, which the replay adds to the
    real times it compares with. Each step says whether its real one computed the same
    shape."""

    def __init__(self, queue: EventQueue, epoch: float, steps: list[StepRecord]) -> None:
        self._queue, self._epoch = queue, epoch
        self._steps = steps
        self._starts = [step.started for step in steps]
        gaps = [
            b.started - (a.started + a.seconds)
            for a, b in itertools.pairwise(steps)
            if b.started - (a.started + a.seconds) < BACK_TO_BACK_S
        ]
        self.between = between = statistics.median(gaps) if gaps else 0.0
        self._cycles = [
            b.started - a.started
            if b.started - (a.started + a.seconds) < BACK_TO_BACK_S
            else a.seconds + between
            for a, b in itertools.pairwise(steps)
        ] + ([steps[-1].seconds + between] if steps else [])
        self.matched = self.steps = 0

    def step(self, step: StepShape) -> float:
        now = self._queue.now - self._epoch
        index = bisect.bisect_left(self._starts, now)
        near = min(
            (i for i in (index - 1, index) if 0 <= i < len(self._steps)),
            key=lambda i: abs(self._starts[i] - now),
        )
        real = self._steps[near]
        self.steps += 1
        self.matched += (real.prefill_tokens, real.decode_seqs) == (
            step.prefill_tokens,
            step.decode_seqs,
        )
        # It ends where the real next one began: a request the engine core took in
        # between two steps (where it reads its input) is in the next one here too.
        cycle = self._cycles[near]
        until_next = self._starts[near] + cycle - now
        return until_next if until_next >= cycle / 2 else cycle

    def decode_run_ends(self, batch: int, context_tokens: int, steps: int) -> list[float]:
        raise AssertionError("a replay runs its steps one at a time")


def replay(run: ServedRun, profile: Path) -> dict[str, Any]:
    """``run`` offline with its measured steps and the engine core's arrivals:
    per-request errors and the steps whose shape the simulated scheduler matched."""
    config = simulated_application("single", str(profile))
    cluster = OfflineCluster(config)
    (engine,) = cluster.engines.values()
    measured = MeasuredSteps(cluster.queue, cluster.epoch, run.steps)
    engine.time_steps_by(measured)
    rng = random.Random(0)
    # The run's own requests (its warm-up ones came before its start).
    served = sorted(
        (record for record in run.engine_requests if record.arrived >= 0),
        key=lambda record: record.arrived,
    )
    arrivals = [
        Arrival(
            index,
            record.arrived,
            [rng.randrange(10, 250) for _ in range(record.prompt_tokens)],
            record.output_tokens,
        )
        for index, record in enumerate(served)
    ]
    outcomes = cluster.run(arrivals)
    ttft, last = [], []
    shift = measured.between
    for record, outcome in zip(served, outcomes, strict=True):
        real_ttft = record.first_token + shift - record.arrived
        ttft.append(abs((outcome.token_times[0] - record.arrived) / real_ttft - 1))
        real_last = record.last_token + shift - record.arrived
        last.append(abs((outcome.token_times[-1] - record.arrived) / real_last - 1))
    return {
        "requests": len(outcomes),
        "ttft_median": statistics.median(ttft),
        "e2e_median": statistics.median(last),
        "steps_matched": measured.matched / max(1, measured.steps),
    }


def print_table(title: str, judged: dict[str, dict[str, dict[str, float]]]) -> None:
    table = Table(title=title)
    table.add_column("bucket")
    table.add_column("steps", justify="right")
    for name in judged:
        table.add_column(f"{name} median", justify="right")
        table.add_column(f"{name} p90", justify="right")
    first = next(iter(judged.values()))
    for bucket_name, counts in first.items():
        cells = [bucket_name, str(counts["steps"])]
        for result in judged.values():
            figures = result.get(bucket_name, {"median": float("nan"), "p90": float("nan")})
            mark = " ✓" if figures["median"] <= TARGET else ""
            cells += [f"{100 * figures['median']:.1f}%{mark}", f"{100 * figures['p90']:.1f}%"]
        table.add_row(*cells)
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="general,prefill-heavy,decode-heavy")
    parser.add_argument("--rates", default="2,8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=Path, help="a profile to judge beside the fit")
    parser.add_argument(
        "--engine-core", type=int, help="bind the engine to this core, the client off it"
    )
    parser.add_argument("--runs", type=Path, help="judge an earlier run's runs.json")
    parser.add_argument("--out", type=Path, default=Path("results/step_ruler"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.runs is not None:
        runs = [_run_of(item) for item in json.loads(args.runs.read_text())]
    else:
        runs = collect(args)
        saved = [
            {
                **vars(run),
                "steps": [_record(s) for s in run.steps],
                "engine_requests": [_record(r) for r in run.engine_requests],
            }
            for run in runs
        ]
        (args.out / "runs.json").write_text(json.dumps(saved))
    calibration = [step for run in runs if run.round == 0 for step in run.steps]
    held_out = [step for run in runs if run.round > 0 for step in run.steps]
    terms = fit(calibration)
    judged = {"fit": errors(held_out, fitted_seconds(terms))}
    if args.profile is not None:
        judged["profile"] = errors(held_out, profile_seconds(load_profile(str(args.profile))))
    console.print(
        f"fitted on {len(calibration)} calibration steps: "
        + ", ".join(f"{name} {value * 1e6:.3g} us" for name, value in terms.items())
    )
    print_table(f"held-out steps ({len(held_out)}): |predicted / measured - 1|", judged)
    replays = [
        {"workload": run.workload, "rate": run.rate, **replay(run, zero_profile(args.out))}
        for run in runs
        if run.round > 0
    ]
    print_replays(replays)
    result = {
        "calibration_steps": len(calibration),
        "held_out_steps": len(held_out),
        "fitted_terms": terms,
        "calibration_error": errors(calibration, fitted_seconds(terms)),
        "held_out_error": judged,
        "replays": replays,
        "target_median": TARGET,
        "replay_target_median": REPLAY_TARGET,
    }
    (args.out / "step_ruler.json").write_text(json.dumps(result, indent=2))
    console.print(f"saved {args.out / 'step_ruler.json'}")


def print_replays(replays: list[dict[str, Any]]) -> None:
    table = Table(title="scheduler replay on the measured steps: median |simulated / real - 1|")
    for column in ("workload", "rate", "requests", "TTFT", "last token", "steps matched"):
        table.add_column(column, justify="right")
    for row in replays:
        table.add_row(
            row["workload"],
            f"{row['rate']:g}",
            str(row["requests"]),
            _marked(row["ttft_median"], REPLAY_TARGET),
            _marked(row["e2e_median"], REPLAY_TARGET),
            f"{100 * row['steps_matched']:.0f}%",
        )
    console.print(table)


def _marked(error: float, target: float) -> str:
    return f"{100 * error:.1f}%" + (" ✓" if error <= target else "")


def _run_of(item: dict[str, Any]) -> ServedRun:
    steps = [StepRecord(**step) for step in item.pop("steps")]
    engine_requests = [RequestRecord(**r) for r in item.pop("engine_requests", [])]
    return ServedRun(**item, steps=steps, engine_requests=engine_requests)


def _record(record: LogRecord) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__struct_fields__}


if __name__ == "__main__":
    main()
