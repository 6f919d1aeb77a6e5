"""Does deciding each prompt's place pay? (benchmark, not a test; issue 26)

The same two engines in four shapes: dp.yaml (two replicas), pd.yaml (conditional
prefill/decode), pd_always.yaml (every prompt prefilled remotely) and auto.yaml (no
roles; the router picks local or remote prefill, and which engine, per request). Each
shape serves two workloads, the client at the niceness this script runs at:

- **A phase-shifting trace**: chat (short prompts, long answers), then summarization
  (long prompts, short answers), then chat again, each phase at its own Poisson rate,
  with no pause at a phase change. It is written as a traffic record and replayed
  (``--trace recorded``), so every shape gets the same requests at the same seconds.
- **A BurstGPT replay**: the BurstGPT-shaped generator's trace (``T-burst-replay``; the
  real trace is not reachable from this box), sped up to ``--burst-rate``.

Per shape and phase: goodput (requests per second that meet both the TTFT and the TPOT
objective, as DistServe counts it), SLO attainment, where prompts were prefilled (each
response's ``x-splitserve-prefill``, as the load generator records it), and the time to
adapt after each phase change: the first second from which the SLO attainment of the
requests sent in the next ``ADAPT_WINDOW_S`` is back within ``ADAPT_MARGIN`` of what the
phase settles at (its second half). A shape that never gets there is charged the whole
phase. Dropped requests are failures other than a refusal (429/503 from QoS).

Rounds run one after another on one started application; the table shows each figure's
median over the rounds, and the JSON keeps every round.

``--simulate PROFILE`` asks the question where there is compute to spare: each shape on
``--engines`` simulated GPUs (``--prefill-engines`` of them prefill for pd and
pd_always), run offline in virtual time (``loadgen simulate``: the router's own policy
objects, each engine keeping the profile's time), with the SLOs and rates given in the
fleet's time. The phase-shifting trace on 8 simulated H100s:

    python bench/auto.py --simulate h100-llama-3.1-8b --engines 8 --phase-s 30
        --chat-rate 160 --summarize-rate 140 --slo-ttft-ms 250 --slo-tpot-ms 20
        --burst-requests 0 --rounds 2 --out results/auto_h100

    nice -n 15 python bench/auto.py [--rounds 2] [--phase-s 30] [--only dp,pd,pd_always,auto]
        [--phases chat,summarize,chat] [--burst-requests 120] [--out results/auto]

The default rates loaded dp past its SLOs on the box they were chosen on; boxes of this
kind have differed fourfold in speed per token since. Where every shape meets the SLOs
in every phase nothing can be told apart: raise the rates until dp misses (a faster box
took ``--chat-rate 28 --summarize-rate 20 --burst-rate 16 --burst-requests 240``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
import yaml
from rich.console import Console
from rich.table import Table

from deployments.launcher import config_path, serve_run
from loadgen.config import RunConfig, WorkloadConfig
from loadgen.data.burstgpt import BURSTGPT_MEAN_RATE
from loadgen.data.recorded import RECORDED_WORKLOAD, SUPPORTED_VERSION, read_record
from loadgen.outputs.stats import RequestMetrics, ServiceLevel
from loadgen.scheduling.runner import RunResult, execute_run
from loadgen.study.simulate import SimulatedTarget, simulate_run

console = Console(width=150)
SHAPES = ("dp", "pd", "pd_always", "auto")
# The tiny model on two cores, as bench/policies.py: pd.yaml's QoS defends this TTFT.
SLO_TTFT_MS = 1000.0
SLO_TPOT_MS = 50.0
LENGTH_SPREAD = 0.25  # each phase's lengths are uniform in L * (1 +- this)
ADAPT_WINDOW_S = 5.0
ADAPT_STEP_S = 1.0
ADAPT_MARGIN = 0.10  # attainment back within 10 points of the phase's settled figure
MIN_WINDOW_REQUESTS = 3
RECORD_BLOCK_TOKENS = 16  # the record format's block size; the trace shares no blocks


@dataclass(frozen=True)
class Phase:
    name: str
    input_len: int
    output_len: int
    rate: float  # requests/s, Poisson


DEFAULT_PHASES = "chat,summarize,chat"


def make_phases(names: str, chat_rate: float, summarize_rate: float) -> list[Phase]:
    """The trace's phases in order, by name (``--phases``: one phase alone isolates a
    shape's cost in it)."""
    known = {
        "chat": Phase("chat", input_len=128, output_len=192, rate=chat_rate),
        "summarize": Phase("summarize", input_len=1800, output_len=24, rate=summarize_rate),
    }
    unknown = sorted(set(names.split(",")) - set(known))
    if unknown:
        raise SystemExit(f"--phases: unknown {unknown}; known: {sorted(known)}")
    return [known[name] for name in names.split(",")]


@dataclass(frozen=True)
class PhaseWindow:
    name: str
    start_s: float
    end_s: float


def write_phase_trace(
    phases: list[Phase], phase_s: float, seed: int, path: Path
) -> list[PhaseWindow]:
    """The phases as a traffic record (router/observation/traffic_record.py's format)."""
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    windows: list[PhaseWindow] = []
    start = 0.0
    for phase in phases:
        # The first request at 0: the replay counts from it, and the windows from 0.
        at = start + (rng.exponential(1 / phase.rate) if rows else 0.0)
        while at < start + phase_s:
            rows.append(
                {
                    "t": round(at, 6),
                    "in": _spread(rng, phase.input_len),
                    "out": _spread(rng, phase.output_len),
                    "prefix": [],
                }
            )
            at += rng.exponential(1 / phase.rate)
        windows.append(PhaseWindow(phase.name, start, start + phase_s))
        start += phase_s
    header = {"version": SUPPORTED_VERSION, "block_tokens": RECORD_BLOCK_TOKENS, "started": 0.0}
    lines = [json.dumps({"header": header}), *(json.dumps(row) for row in rows)]
    path.write_text("\n".join(lines) + "\n")
    return windows


def _spread(rng: np.random.Generator, length: int) -> int:
    return max(1, int(rng.uniform(length * (1 - LENGTH_SPREAD), length * (1 + LENGTH_SPREAD))))


def placements(requests: list[RequestMetrics]) -> dict[str, int]:
    """Where the router computed each prompt (its x-splitserve-prefill header), by
    ``where:reason`` and by ``where``."""
    counts: Counter[str] = Counter()
    for request in requests:
        if request.prefill:
            counts[request.prefill] += 1
            counts[request.prefill.split(":", 1)[0]] += 1
    return dict(sorted(counts.items()))


def phase_figures(
    requests: list[RequestMetrics], window: PhaseWindow, level: ServiceLevel
) -> dict[str, Any]:
    inside = [
        r for r in requests if not r.warmup and window.start_s <= r.scheduled_s < window.end_s
    ]
    met = [r for r in inside if level.met_by(r)]
    return {
        "phase": window.name,
        "requests": len(inside),
        "goodput": len(met) / (window.end_s - window.start_s),
        "slo_attainment": len(met) / len(inside) if inside else None,
        "ttft_p50_ms": _p50_ms([r.ttft_s for r in inside]),
        "tpot_p50_ms": _p50_ms([r.tpot_s for r in inside]),
        **_failures(inside),
        "adapt_s": adapt_seconds(inside, window, level),
        "prefill": placements(inside),
    }


def _p50_ms(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) * 1000 if present else None


def adapt_seconds(
    inside: list[RequestMetrics], window: PhaseWindow, level: ServiceLevel
) -> float | None:
    """Seconds from the phase's start until the attainment of a sliding window of sent
    requests first comes back within ADAPT_MARGIN of the phase's second half."""
    middle = (window.start_s + window.end_s) / 2
    settled = [level.met_by(r) for r in inside if r.scheduled_s >= middle]
    if not settled:
        return None
    target = sum(settled) / len(settled) - ADAPT_MARGIN
    at = window.start_s
    while at + ADAPT_WINDOW_S <= window.end_s:
        sent = [r for r in inside if at <= r.scheduled_s < at + ADAPT_WINDOW_S]
        if len(sent) >= MIN_WINDOW_REQUESTS and sum(map(level.met_by, sent)) / len(sent) >= target:
            return at - window.start_s
        at += ADAPT_STEP_S
    return window.end_s - window.start_s


def whole_run(result: RunResult, seconds: float, level: ServiceLevel) -> dict[str, Any]:
    s = result.summary
    measured = [r for r in result.requests if not r.warmup]
    met = sum(map(level.met_by, measured))
    return {
        "requests": len(measured),
        "goodput": met / seconds,
        "slo_attainment": met / len(measured) if measured else None,
        "ttft_p50_ms": s.ttft.p50 * 1000,
        "itl_mean_ms": s.itl.mean * 1000,
        "itl_p50_ms": s.itl.p50 * 1000,
        **_failures(measured),
    }


def _failures(requests: list[RequestMetrics]) -> dict[str, int]:
    """Refused: the QoS layer's 429/503 (outcome ``rejected``); dropped: anything else
    that failed (outcome ``error``)."""
    return {
        "refused": sum(r.outcome == "rejected" for r in requests),
        "dropped": sum(r.outcome == "error" for r in requests),
    }


def run_config(base_url: str, args: argparse.Namespace, **fields: Any) -> RunConfig:
    return RunConfig(
        base_url=base_url,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        show_progress=False,
        # Each response says where its prompt ran; scraping would only add load.
        server_metrics=False,
        **fields,
    )


def measure_shape(
    shape: str, traces: list[Path], windows: list[PhaseWindow], args: argparse.Namespace
) -> dict[str, Any]:
    if args.simulate:
        target = SimulatedTarget(str(fleet_config(shape, args)), args.simulate)
        return measure_rounds(shape, traces, windows, args, SIMULATED_URL, target)
    with serve_run(shape) as app:
        return measure_rounds(shape, traces, windows, args, app.base_url, None)


SIMULATED_URL = "http://simulated.invalid"  # offline runs send nothing


def fleet_config(shape: str, args: argparse.Namespace) -> Path:
    """The shape on ``--engines`` engines: dp and auto all alike, pd and pd_always with
    ``--prefill-engines`` prefilling; each engine as a GPU of the profile's."""
    document = yaml.safe_load(config_path(shape).read_text())
    pools = document["applications"][0]["args"]["pools"]
    prefill = args.prefill_engines or args.engines // 2
    counts = {"mixed": args.engines, "prefill": prefill, "decode": args.engines - prefill}
    for pool in pools:
        pool.pop("cpu_binds", None)
        pool["replicas"] = counts[pool.get("role", "mixed")]
    path = args.out / f"{shape}.{args.engines}-engines.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def _run(config: RunConfig, target: SimulatedTarget | None) -> RunResult:
    if target is None:
        return asyncio.run(execute_run(config, Console(quiet=True)))
    return asyncio.run(simulate_run(config, target, Console(quiet=True)))


def measure_rounds(
    shape: str,
    traces: list[Path],
    windows: list[PhaseWindow],
    args: argparse.Namespace,
    base_url: str,
    target: SimulatedTarget | None,
) -> dict[str, Any]:
    level = ServiceLevel(ttft_s=args.slo_ttft_ms / 1000, tpot_s=args.slo_tpot_ms / 1000)
    rounds: list[dict[str, Any]] = []
    for index, trace in enumerate(traces):
        # Same lengths and seconds every round, new tokens: a round that resent the
        # last round's prompts would find them in the prefix cache.
        replay = run_config(
            base_url,
            args,
            workload=WorkloadConfig(name=RECORDED_WORKLOAD, trace_file=trace),
            num_requests=len(read_record(trace).sizes),
            seed=args.seed + index,
        )
        phases = _run(replay, target)
        rows = [phase_figures(phases.requests, window, level) for window in windows]
        trace_s = windows[-1].end_s
        burst = run_burst(base_url, args, args.seed + 100 + index, target)
        rounds.append(
            {
                "phases": rows,
                "trace": whole_run(phases, trace_s, level),
                "burstgpt": burst and whole_run(burst, burst.summary.duration_s, level),
            }
        )
        burst_goodput = rounds[-1]["burstgpt"] and rounds[-1]["burstgpt"]["goodput"]
        console.print(
            f"  {shape} round {index + 1}: trace goodput {rounds[-1]['trace']['goodput']:.2f},"
            f" BurstGPT {_fmt(burst_goodput, '{:.2f}')}"
        )
    return {"rounds": rounds}


def run_burst(
    base_url: str, args: argparse.Namespace, seed: int, target: SimulatedTarget | None
) -> RunResult | None:
    """The BurstGPT replay; None with ``--burst-requests 0``."""
    if args.burst_requests <= 0:
        return None
    config = run_config(
        base_url,
        args,
        workload=WorkloadConfig(
            name="T-burst-replay",
            trace="burstgpt-synthetic",
            time_scale=BURSTGPT_MEAN_RATE / args.burst_rate,
        ),
        num_requests=args.burst_requests,
        seed=seed,
    )
    return _run(config, target)


def median_of(rounds: list[dict[str, Any]], pick: Any) -> float | None:
    values = [v for v in (pick(r) for r in rounds) if v is not None]
    return statistics.median(values) if values else None


def print_tables(results: dict[str, Any], windows: list[PhaseWindow]) -> None:
    phases = Table(title="phase-shifting trace: medians over the rounds")
    for column in ("shape", "phase", "goodput", "SLO met", "TTFT p50", "TPOT p50"):
        phases.add_column(column, justify="right")
    for column in ("adapt", "remote/local", "refused", "dropped"):
        phases.add_column(column, justify="right")
    for shape, result in results.items():
        rounds = result["rounds"]
        for i, window in enumerate(windows):

            def at(key: str, i: int = i, rounds: list[dict[str, Any]] = rounds) -> float | None:
                return median_of(rounds, lambda r: r["phases"][i][key])

            phases.add_row(
                shape,
                f"{i + 1}. {window.name}",
                _fmt(at("goodput"), "{:.2f}"),
                _fmt(at("slo_attainment"), "{:.0%}"),
                _fmt(at("ttft_p50_ms"), "{:.0f} ms"),
                _fmt(at("tpot_p50_ms"), "{:.1f} ms"),
                "-" if i == 0 else _fmt(at("adapt_s"), "{:.0f} s"),
                f"{_fmt(_prefill(rounds, i, 'remote'), '{:.0f}')}"
                f"/{_fmt(_prefill(rounds, i, 'local'), '{:.0f}')}",
                _fmt(at("refused"), "{:.0f}"),
                _fmt(at("dropped"), "{:.0f}"),
            )
    console.print(phases)
    whole = Table(title="whole runs: medians over the rounds (goodput, SLO met, dropped)")
    for column in ("shape", "trace", "BurstGPT replay", "ITL mean / p50 (trace)"):
        whole.add_column(column, justify="right")
    for shape, result in results.items():
        rounds = result["rounds"]
        whole.add_row(
            shape,
            _whole_cell(rounds, "trace"),
            _whole_cell(rounds, "burstgpt"),
            f"{_fmt(median_of(rounds, lambda r: r['trace']['itl_mean_ms']), '{:.1f}')} /"
            f" {_fmt(median_of(rounds, lambda r: r['trace']['itl_p50_ms']), '{:.1f}')} ms",
        )
    console.print(whole)


def _prefill(rounds: list[dict[str, Any]], phase: int, where: str) -> float | None:
    return median_of(rounds, lambda r: r["phases"][phase]["prefill"].get(where))


def _whole_cell(rounds: list[dict[str, Any]], run: str) -> str:
    rounds = [r for r in rounds if r[run] is not None]
    if not rounds:
        return "-"
    goodput = median_of(rounds, lambda r: r[run]["goodput"])
    attainment = median_of(rounds, lambda r: r[run]["slo_attainment"])
    dropped = max(r[run]["dropped"] for r in rounds)
    return f"{_fmt(goodput, '{:.2f}')}, {_fmt(attainment, '{:.0%}')}, {dropped}"


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only", default=",".join(SHAPES), help="shapes to run: YAML names or paths"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--phase-s", type=float, default=30.0, help="seconds per phase")
    parser.add_argument("--chat-rate", type=float, default=8.0)
    parser.add_argument("--summarize-rate", type=float, default=4.5)
    parser.add_argument("--burst-rate", type=float, default=4.0, help="BurstGPT replay, req/s")
    parser.add_argument(
        "--burst-requests", type=int, default=120, help="BurstGPT replay's requests (0: none)"
    )
    parser.add_argument(
        "--phases", default=DEFAULT_PHASES, help="the trace's phases: chat, summarize, in order"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float, default=SLO_TTFT_MS)
    parser.add_argument("--slo-tpot-ms", type=float, default=SLO_TPOT_MS)
    parser.add_argument("--out", type=Path, default=Path("results/auto"))
    parser.add_argument(
        "--simulate", metavar="PROFILE", help="offline, on simulated engines of this profile"
    )
    parser.add_argument("--engines", type=int, default=2, help="with --simulate: engines")
    parser.add_argument(
        "--prefill-engines", type=int, default=0, help="with --simulate: pd's (0: half)"
    )
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    phases = make_phases(args.phases, args.chat_rate, args.summarize_rate)
    folder = Path(tempfile.mkdtemp(prefix="splitserve-auto-"))
    # Offline runs are deterministic: each round replays a trace of its own seed (the
    # same for every shape). Real ones replay one trace, round after round.
    seeds = [args.seed + i for i in range(args.rounds)] if args.simulate else [args.seed]
    traces = [folder / f"phases-{seed}.jsonl" for seed in seeds]
    for seed, trace in zip(seeds, traces, strict=True):
        # The phases' seconds are the same whatever the seed.
        windows = write_phase_trace(phases, args.phase_s, seed, trace)
    traces = traces * (args.rounds // len(traces))
    results = {}
    for shape in args.only.split(","):
        console.rule(config_path(shape).name)
        results[shape] = measure_shape(shape, traces, windows, args)
        # Saved after every shape: a later shape's failure keeps the earlier figures.
        report = {
            "phases": [asdict(p) for p in phases],
            "windows": [asdict(w) for w in windows],
            "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
            "args": {k: str(v) for k, v in vars(args).items()},
            "shapes": results,
        }
        (args.out / "auto.json").write_text(json.dumps(report, indent=2, default=str))
    print_tables(results, windows)
    console.print(f"saved {args.out / 'auto.json'}")


if __name__ == "__main__":
    main()
