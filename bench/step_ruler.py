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

    python bench/step_ruler.py [--workloads general,prefill-heavy,decode-heavy]
        [--rates 2,8] [--rounds 2] [--num-requests 40] [--profile FILE]
        [--out results/step_ruler]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
import yaml
from rich.console import Console
from rich.table import Table

from deployments.launcher import config_path, niced_like_ray_workers, serve_run
from engines.step_log import StepRecord, read_steps
from loadgen.config import RunConfig, WorkloadConfig
from loadgen.scheduling.runner import execute_run
from splitserve.latency.profile import LatencyProfile, StepShape, load_profile

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
    solution = _nonnegative_least_squares(rows * weights[:, None], seconds * weights)
    return dict(zip(TERMS, (float(value) for value in solution), strict=True))


def _nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every term at least 0: a term whose best value is negative is
    dropped (held at 0) and the rest solved again, the most negative first. Five terms
    need no more than numpy (scipy is not a dependency)."""
    active = list(range(a.shape[1]))
    solution = np.zeros(a.shape[1])
    while active:
        values, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (values >= 0).all():
            solution[active] = values
            break
        active.pop(int(np.argmin(values)))
    return solution


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


def logging_config(out: Path) -> Path:
    """single.yaml with its engine logging steps under ``out``/steps."""
    document = yaml.safe_load(config_path("single").read_text())
    args = document["applications"][0]["args"]
    args["engine"] = {**args.get("engine", {}), "step_log": str((out / "steps").resolve())}
    path = out / "single-step-log.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def collect(args: argparse.Namespace) -> dict[int, list[StepRecord]]:
    """Each round's steps: every cell run once a round, on one started engine."""
    cells = [(w, r) for w in args.workloads.split(",") for r in map(float, args.rates.split(","))]
    by_round: dict[int, list[StepRecord]] = {}
    with serve_run(str(logging_config(args.out))) as app:
        logs = args.out / "steps"
        for round_index in range(args.rounds):
            for cell, (workload, rate) in enumerate(cells):
                before = {log: len(read_steps(log)) for log in logs.glob("*.jsonl")}
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
                    asyncio.run(execute_run(run, Console(quiet=True)))
                for log in logs.glob("*.jsonl"):
                    new = read_steps(log)[before.get(log, 0) :]
                    by_round.setdefault(round_index, []).extend(new)
                console.print(
                    f"round {round_index + 1}, {workload} at {rate:g}/s:"
                    f" {len(by_round.get(round_index, []))} steps so far"
                )
    return by_round


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
        "--steps", type=Path, help="judge the steps of an earlier run (its steps.json)"
    )
    parser.add_argument("--out", type=Path, default=Path("results/step_ruler"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.steps is not None:
        saved = json.loads(args.steps.read_text())
        by_round = {int(k): [StepRecord(**s) for s in v] for k, v in saved.items()}
    else:
        by_round = collect(args)
        (args.out / "steps.json").write_text(
            json.dumps({k: [_record(s) for s in v] for k, v in by_round.items()})
        )
    calibration = by_round[0]
    held_out = [step for index, steps in by_round.items() if index > 0 for step in steps]
    terms = fit(calibration)
    judged = {"fit": errors(held_out, fitted_seconds(terms))}
    if args.profile is not None:
        judged["profile"] = errors(held_out, profile_seconds(load_profile(str(args.profile))))
    console.print(
        f"fitted on {len(calibration)} calibration steps: "
        + ", ".join(f"{name} {value * 1e6:.3g} us" for name, value in terms.items())
    )
    print_table(f"held-out steps ({len(held_out)}): |predicted / measured - 1|", judged)
    result = {
        "calibration_steps": len(calibration),
        "held_out_steps": len(held_out),
        "fitted_terms": terms,
        "calibration_error": errors(calibration, fitted_seconds(terms)),
        "held_out_error": judged,
        "target_median": TARGET,
    }
    (args.out / "step_ruler.json").write_text(json.dumps(result, indent=2))
    console.print(f"saved {args.out / 'step_ruler.json'}")


def _record(step: StepRecord) -> dict[str, Any]:
    return {name: getattr(step, name) for name in StepRecord.__struct_fields__}


if __name__ == "__main__":
    main()
