"""Does a simulated engine keep the real engine's time? (benchmark, not a test)

A latency profile is fitted from the CPU engine on its own grid (python -m loadgen
profile: lone prefills, lockstep decode batches), then each config is served twice, on
its real vLLM engines and on simulated engines that keep that profile's time
(deployments.serve --simulate), under the same workloads, rates and seeds. Real and
simulated runs alternate within each round; the table gives each metric's median over
the rounds and the simulated/real ratio. The runs compared are never the runs the
profile was fitted on.

    python bench/sim_fidelity.py [--configs single,dp,pd_always,auto]
        [--workloads general,prefill-heavy,decode-heavy,T-general] [--rates 1,2,4]
        [--trace burstgpt-synthetic|burstgpt]
        [--rounds 2] [--num-requests 40] [--profile FILE | --fit-cores 1]
        [--profile-b FILE | --fit-handover-cpu] [--spend wall|cpu]
        [--out results/sim_fidelity] [--tables-only]

The profile fits one engine: on both cores for single.yaml, on one (``--fit-cores 1``)
for the configs that pin each engine to a core of its own. A simulated engine that
sleeps its steps (``--spend wall``) leaves the cores to the router and the client, which
a real CPU engine shares them with; ``--spend cpu`` computes each step on the engine's
cores instead (engine.spend), so both contend for this box's cores alike. A fit for a
PD config (pd_always, auto) also fits the hand-over, from lone prefills through
pd_always.yaml (python -m loadgen profile --handover-of).

Each table ends with two counts: the simulated figures within 10% of the real ones, and
the real figures within 10% of themselves between rounds (largest over smallest). The
second is the ruler's resolution on this box.

The end-to-end ruler (issue 56) follows each table: every figure's simulated error (the
simulated median against the real rounds' median) beside the real engine's own spread
(the largest distance of a real round from that median), and the figure counts as a
match where the error is inside the spread. It needs three rounds or more: with two,
the median sits halfway and every spread is half the rounds' difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import psutil
import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
import yaml
from rich.console import Console
from rich.table import Table

from deployments.launcher import (
    REPO_ROOT,
    RunningApp,
    config_path,
    niced_like_ray_workers,
    serve_run,
    simulated_config,
)
from loadgen.config import CUSTOM_WORKLOAD, RunConfig, WorkloadConfig
from loadgen.scheduling.runner import RunResult, execute_run
from loadgen.study.simulate import SimulatedTarget, simulate_run
from splitserve.latency.profile import LatencyProfile, load_profile

console = Console()
METRICS = ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms", "output_tok_s")
FIDELITY_TOLERANCE = 0.10  # issue 42's bar: a simulated figure within 10% of the real one
SPREAD_TARGET = 0.90  # issue 56: figures whose simulated error is inside the real spread
Cell = tuple[str, str, float]  # config, workload, rate
# The configs that hand prompts over: a profile fitted for them fits the hand-over too.
PD_CONFIGS = ("pd", "pd_always", "auto")
SIMULATED, SIMULATED_B = "simulated", "simulated_b"  # the runs on --profile, --profile-b
# The embedded model's KV per token: K and V, 2 layers, 2 KV heads of 32, float32.
EMBEDDED_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4
# single.yaml's cache: 1 GiB (kv_cache_gib) of blocks of 128 tokens.
EMBEDDED_KV_CAPACITY_TOKENS = (1 << 30) // EMBEDDED_KV_BYTES_PER_TOKEN
CPU_BLOCK_SIZE = 128  # vLLM's CPU platform default
CPU_MAX_NUM_SEQS = 128  # vLLM's CPU default for an OpenAI server, one rank


def zero_profile(out: Path) -> Path:
    """An engine that takes no time, on the embedded model's cache: the path alone."""
    path = out / "zero-tp1-pp1.yaml"
    LatencyProfile(
        device="none",
        model="embedded",
        source="an engine that takes no time: what the serving path costs alone",
        step_overhead_s=0.0,
        weights_read_s=0.0,
        compute_per_token_s=0.0,
        per_context_token_s=0.0,
        per_attention_pair_s=0.0,
        kv_bytes_per_token=EMBEDDED_KV_BYTES_PER_TOKEN,
        kv_capacity_tokens=EMBEDDED_KV_CAPACITY_TOKENS,
        handover_bytes_per_s=1e15,
        block_size=CPU_BLOCK_SIZE,
        max_num_seqs=CPU_MAX_NUM_SEQS,
    ).save(path)
    return path


def profile_command(base_url: str, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "loadgen",
        "profile",
        "--base-url",
        base_url,
        "--device",
        "cpu-2core",
        "--model-name",
        "embedded",
        "--kv-bytes-per-token",
        str(EMBEDDED_KV_BYTES_PER_TOKEN),
        "--kv-capacity-tokens",
        str(EMBEDDED_KV_CAPACITY_TOKENS),
        "--block-size",
        str(CPU_BLOCK_SIZE),
        "--max-num-seqs",
        str(CPU_MAX_NUM_SEQS),
        "--repeats",
        "5",
        # Up to the batches and prompts the workloads reach at their highest rate.
        "--prompt-lengths",
        "16,64,256,512,1024,2048",
        "--batches",
        "1,2,4,8,16,32,64",
        "--contexts",
        "64,512,1536",
        "--out",
        str(out),
        *extra,
    ]


def fit_config(out: Path, cores: int) -> Path:
    """The engine a profile is fitted on: single.yaml's, on both cores (as single.yaml
    runs it) or pinned to one (as dp, pd_always and auto pin each of their engines: one
    core is this box's "one GPU")."""
    if cores == 2:
        return config_path("single")
    document = yaml.safe_load(config_path("single").read_text())
    document["applications"][0]["args"]["pools"][0]["cpu_binds"] = ["0"]
    path = out / "single-one-core.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def fit_profile(out: Path, cores: int, handover: bool, spend: str) -> Path:
    """Fit the CPU engine's profile on ``fit_config`` (its own grid, not the runs below),
    less what single.yaml's router costs alone (measured on zero-time engines); with
    ``handover``, its PD hand-over too, from lone prefills through pd_always.yaml (less
    that application's own path, also measured on zero-time engines), and with ``spend``
    cpu the host CPU a hand-over costs (``fit_handover_cpu``)."""
    baseline = out / "path-alone.yaml"
    zero = str(zero_profile(out))
    _profile_run(simulated_config(config_path("single"), zero), baseline)
    path = out / f"cpu{cores}-embedded-tp1-pp1.yaml"
    extra = ("--baseline-samples", str(baseline.with_suffix(".samples.json")))
    _profile_run(fit_config(out, cores), path, *extra)
    if handover:
        fit_handover(out, path)
        if spend == "cpu":
            fit_handover_cpu(path)
    return path


def fit_handover(out: Path, profile: Path) -> None:
    """Fit ``profile``'s hand-over in place: lone prefills through pd_always.yaml over the
    same on one engine, less that application's own path (on zero-time engines)."""
    pd_baseline = out / "pd-path-alone.yaml"
    pd_always = config_path("pd_always")
    _profile_run(simulated_config(pd_always, str(zero_profile(out))), pd_baseline)
    baseline_samples = str(pd_baseline.with_suffix(".samples.json"))
    with serve_run(str(pd_always)) as app, niced_like_ray_workers():
        command = [sys.executable, "-m", "loadgen", "profile", "--base-url", app.base_url]
        command += ["--handover-of", str(profile), "--baseline-samples", baseline_samples]
        subprocess.run([*command, "--repeats", "5"], check=True, cwd=REPO_ROOT)


# The burst a hand-over's host CPU is measured on: short prompts, a token or two each, all
# at once, so that hand-overs (not decodes) make most of the work.
HANDOVER_BURST = {"requests": 48, "input_len": 256, "output_len": 2, "repeats": 3}


def box_cpu_seconds() -> float:
    """CPU time every process on this box has spent since it started."""
    times = psutil.cpu_times()
    return float(times.user + times.nice + times.system + times.irq + times.softirq)


def cpu_per_request(app: RunningApp, seed: int) -> float:
    """The box's CPU seconds per request over bursts of HANDOVER_BURST."""
    spent = []
    for repeat in range(HANDOVER_BURST["repeats"]):
        run = RunConfig(
            base_url=app.base_url,
            workload=WorkloadConfig(
                name=CUSTOM_WORKLOAD,
                input_len=HANDOVER_BURST["input_len"],
                output_len=HANDOVER_BURST["output_len"],
            ),
            qps=float("inf"),
            num_requests=HANDOVER_BURST["requests"],
            seed=seed + repeat,  # fresh prompts: none found in the prefix cache
            show_progress=False,
        )
        before = box_cpu_seconds()
        with niced_like_ray_workers():
            asyncio.run(execute_run(run, Console(quiet=True)))
        spent.append((box_cpu_seconds() - before) / HANDOVER_BURST["requests"])
    return statistics.median(spent)


def fit_handover_cpu(profile: Path) -> None:
    """Set ``profile``'s handover_cpu_s: the box's CPU per request through pd_always over
    dp on real engines, less the same on simulated ones that spend their steps as CPU
    (so the steps cancel, and their router pays the second hop for real)."""
    per_request = {}
    for kind in ("real", "simulated"):
        for config in ("dp", "pd_always"):
            with served(config, kind, {SIMULATED: profile}, "cpu") as app:
                per_request[(kind, config)] = cpu_per_request(app, seed=1000)
    real = per_request[("real", "pd_always")] - per_request[("real", "dp")]
    simulated = per_request[("simulated", "pd_always")] - per_request[("simulated", "dp")]
    fitted = load_profile(str(profile)).model_copy(
        update={"handover_cpu_s": max(0.0, real - simulated)}
    )
    fitted.save(profile)
    console.print(
        "CPU s a request, pd_always over dp: real "
        + f"{real * 1e3:.2f} ms, simulated {simulated * 1e3:.2f} ms;"
        + f" handover_cpu_s {fitted.handover_cpu_s * 1e3:.2f} ms"
        + f" ({', '.join(f'{k[0]} {k[1]} {v * 1e3:.2f}' for k, v in per_request.items())})"
    )


def _profile_run(config: Path, out: Path, *extra: str) -> None:
    with serve_run(str(config)) as app, niced_like_ray_workers():
        command = profile_command(app.base_url, out, *extra)
        subprocess.run(command, check=True, cwd=REPO_ROOT)


def served(
    config: str, kind: str, profiles: dict[str, Path], spend: str
) -> AbstractContextManager[RunningApp]:
    path = config_path(config)
    if kind in profiles:
        path = simulated_config(path, str(profiles[kind]), spend=spend)
    return serve_run(str(path))


def run_config(
    base_url: str, workload: str, rate: float, cell: int, args: argparse.Namespace
) -> RunConfig:
    return RunConfig(
        base_url=base_url,
        # BurstGPT's subsets (T-*) are drawn from its CSV or, where it cannot be fetched,
        # from the trace with BurstGPT's shape (loadgen's burstgpt-synthetic).
        workload=WorkloadConfig(name=workload, trace=args.trace),
        qps=rate,
        num_requests=args.num_requests,
        # Fresh prompts in every cell: a cell that resent the last one's prompts would
        # find them in the prefix cache.
        seed=args.seed + cell,
        show_progress=False,
    )


def row_of(result: RunResult) -> dict[str, Any]:
    summary = result.summary
    return {
        "ttft_p50_ms": summary.ttft.p50 * 1000,
        "ttft_p90_ms": summary.ttft.p90 * 1000,
        "itl_p50_ms": summary.itl.p50 * 1000,
        "itl_p90_ms": summary.itl.p90 * 1000,
        "output_tok_s": summary.output_token_throughput,
        "errors": summary.errors + summary.rejected,
    }


def cells(args: argparse.Namespace) -> list[tuple[int, str, float]]:
    pairs = [(w, r) for w in args.workloads for r in args.rates]
    return [(index, workload, rate) for index, (workload, rate) in enumerate(pairs)]


def served_rows(
    app: RunningApp, config: str, kind: str, round_index: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    rows = []
    for cell, workload, rate in cells(args):
        run = run_config(app.base_url, workload, rate, cell, args)
        with niced_like_ray_workers():
            result = asyncio.run(execute_run(run, Console(quiet=True)))
        rows.append(_labelled(row_of(result), round_index, config, kind, workload, rate))
    return rows


def path_ms(out: Path) -> float:
    """What single.yaml's router costs a request alone (its TTFT on zero-time engines,
    median over prompt lengths), which virtual time leaves out; 0 if unmeasured."""
    samples = out / "path-alone.samples.json"
    if not samples.exists():
        return 0.0
    prefills = json.loads(samples.read_text())["prefill"]
    return 1000 * statistics.median(float(sample["seconds"]) for sample in prefills)


def offline_rows(
    config: str, profile: Path, round_index: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """The same cells in virtual time (python -m loadgen simulate's path)."""
    rows = []
    target = SimulatedTarget(config, str(profile), path_ms=path_ms(args.out))
    for cell, workload, rate in cells(args):
        run = run_config("http://offline", workload, rate, cell, args)
        result = asyncio.run(simulate_run(run, target, Console(quiet=True)))
        rows.append(_labelled(row_of(result), round_index, config, "offline", workload, rate))
    return rows


def _labelled(
    row: dict[str, Any], round_index: int, config: str, kind: str, workload: str, rate: float
) -> dict[str, Any]:
    row.update(round=round_index, config=config, kind=kind, workload=workload, rate=rate)
    console.print(
        f"round {round_index} {config} {kind} {workload} @ {rate:g}:"
        f" TTFT p50 {row['ttft_p50_ms']:.1f} ms, ITL p50 {row['itl_p50_ms']:.2f} ms,"
        f" {row['output_tok_s']:.0f} tok/s"
    )
    return row


def run_rounds(args: argparse.Namespace, profile: Path) -> list[dict[str, Any]]:
    profiles = {SIMULATED: profile}
    if args.profile_b:
        profiles[SIMULATED_B] = args.profile_b
    rows = []
    for round_index in range(args.rounds):
        for config in args.configs:
            # Alternate which goes first, so none always runs on a fresher box.
            kinds = ("real", *profiles)
            for kind in kinds if round_index % 2 == 0 else reversed(kinds):
                with served(config, kind, profiles, args.spend) as app:
                    rows += served_rows(app, config, kind, round_index, args)
            if round_index == 0:  # virtual time: the same every round
                rows += offline_rows(config, profile, round_index, args)
    return rows


def medians(rows: list[dict[str, Any]]) -> dict[tuple[str, str, float, str], dict[str, float]]:
    cells: dict[tuple[str, str, float, str], list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["config"], row["workload"], row["rate"], row["kind"])
        cells.setdefault(key, []).append(row)
    return {
        key: {metric: statistics.median(r[metric] for r in group) for metric in METRICS}
        for key, group in cells.items()
    }


def within(ratio: float, tolerance: float = FIDELITY_TOLERANCE) -> bool:
    return abs(ratio - 1) <= tolerance


def real_rounds(rows: list[dict[str, Any]]) -> dict[Cell, list[dict[str, Any]]]:
    """Each cell's real runs, one a round."""
    by_cell: dict[Cell, list[dict[str, Any]]] = {}
    for row in rows:
        if row["kind"] == "real":
            by_cell.setdefault((row["config"], row["workload"], row["rate"]), []).append(row)
    return by_cell


def real_rounds_ratios(rows: list[dict[str, Any]]) -> dict[Cell, dict[str, float]]:
    """Each cell's real runs against each other: the largest round's figure over the
    smallest's, per metric. It is the ruler's resolution on this box: a simulator cannot
    be shown closer to the real engine than the real engine is to itself."""
    return {
        cell: {
            m: max(r[m] for r in group) / min(r[m] for r in group)
            for m in METRICS
            if min(r[m] for r in group) > 0
        }
        for cell, group in real_rounds(rows).items()
        if len(group) > 1
    }


def agreement_counts(compared: list[dict[str, Any]]) -> dict[str, int]:
    """How many figures the simulator gets within the tolerance of the real engine, and
    how many the real engine gets within it of itself between rounds."""
    figures = [v for cell in compared for v in cell["simulated_over_real"].values()]
    spreads = [v for cell in compared for v in (cell["real_rounds"] or {}).values()]
    return {
        "figures": len(figures),
        "simulated_within": sum(within(v) for v in figures),
        "real_round_pairs": len(spreads),
        "real_rounds_within": sum(within(v) for v in spreads),
    }


def real_spread(rows: list[dict[str, Any]]) -> dict[Cell, dict[str, float]]:
    """Each cell's real rounds around their median, per metric: the largest
    |round / median - 1|. A simulated figure this close to the median is as close as
    the real engine's own rounds come to it."""
    spread = {}
    for cell, group in real_rounds(rows).items():
        if len(group) < 2:
            continue
        middle = {m: statistics.median(r[m] for r in group) for m in METRICS}
        spread[cell] = {
            m: max(abs(r[m] / middle[m] - 1) for r in group) for m in METRICS if middle[m] > 0
        }
    return spread


def spread_figures(
    compared: list[dict[str, Any]], spread: dict[Cell, dict[str, float]]
) -> list[dict[str, Any]]:
    """One entry per figure of a cell with real rounds: its simulated error, the real
    spread and whether the error is inside it."""
    figures = []
    for cell in compared:
        key = (cell["config"], cell["workload"], cell["rate"])
        for metric, ratio in cell["simulated_over_real"].items():
            if metric in spread.get(key, {}):
                error, real = abs(ratio - 1), spread[key][metric]
                figures.append(
                    {
                        "config": key[0],
                        "workload": key[1],
                        "rate": key[2],
                        "metric": metric,
                        "simulated_error": error,
                        "real_spread": real,
                        "inside": error <= real,
                    }
                )
    return figures


def over_real(rows: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """Each cell's ``kind`` median over the real median, per metric, as print_table's
    cells carry it (for the offline runs, which that table sets beside the simulated)."""
    by_cell = medians(rows)
    cells = []
    for config, workload, rate, row_kind in sorted(by_cell):
        real = by_cell.get((config, workload, rate, "real"))
        if row_kind != kind or real is None:
            continue
        figures = by_cell[(config, workload, rate, kind)]
        ratio = {m: figures[m] / real[m] for m in METRICS if real[m]}
        cells.append(
            {"config": config, "workload": workload, "rate": rate, "simulated_over_real": ratio}
        )
    return cells


def print_spread(figures: list[dict[str, Any]], rounds: int, kind: str) -> None:
    table = Table(
        title=f"end to end: |{kind} / real - 1| against the real spread over {rounds}"
        " rounds (largest |round / median - 1|); * inside"
    )
    for column in ("config", "workload", "req/s", *METRICS):
        table.add_column(column, justify="right")
    by_cell: dict[Cell, dict[str, dict[str, Any]]] = {}
    for f in figures:
        by_cell.setdefault((f["config"], f["workload"], f["rate"]), {})[f["metric"]] = f
    for (config, workload, rate), row in sorted(by_cell.items()):
        table.add_row(
            config,
            workload,
            f"{rate:g}",
            *(
                f"{row[m]['simulated_error']:.1%} / {row[m]['real_spread']:.1%}"
                + (" *" if row[m]["inside"] else "")
                if m in row
                else ""
                for m in METRICS
            ),
        )
    console.print(table)
    inside = sum(f["inside"] for f in figures)
    share = inside / len(figures) if figures else 0.0
    console.print(
        f"inside the real spread: {inside} of {len(figures)} figures ({share:.0%}; target"
        f" {SPREAD_TARGET:.0%})"
    )


def print_table(rows: list[dict[str, Any]], simulated: str = SIMULATED) -> list[dict[str, Any]]:
    table = Table(
        title=f"real / {simulated} (ratio) / offline (ratio to simulated); medians over"
        " rounds; this box: 2 cores, no GPU"
    )
    for column in ("config", "workload", "req/s", *METRICS):
        table.add_column(column, justify="right")
    by_cell = medians(rows)
    spreads = real_rounds_ratios(rows)
    compared = []
    for config, workload, rate, kind in sorted(by_cell):
        if kind != "real":
            continue
        real = by_cell[(config, workload, rate, "real")]
        sim = by_cell.get((config, workload, rate, simulated))
        offline = by_cell.get((config, workload, rate, "offline"))
        if sim is None:
            continue
        ratio = {m: sim[m] / real[m] for m in METRICS if real[m]}
        agreement = {m: offline[m] / sim[m] for m in METRICS if offline and sim[m]}
        compared.append(
            {
                "config": config,
                "workload": workload,
                "rate": rate,
                "real": real,
                "simulated": sim,
                "offline": offline,
                "simulated_over_real": ratio,
                "offline_over_simulated": agreement,
                "real_rounds": spreads.get((config, workload, rate)),
            }
        )
        table.add_row(
            config,
            workload,
            f"{rate:g}",
            *(
                f"{real[m]:.1f} / {sim[m]:.1f} ({ratio.get(m, float('nan')):.2f})"
                + (f" / {offline[m]:.1f} ({agreement[m]:.2f})" if offline else "")
                for m in METRICS
            ),
        )
    console.print(table)
    counts = agreement_counts(compared)
    console.print(
        f"simulated within {FIDELITY_TOLERANCE:.0%} of real: {counts['simulated_within']}"
        f" of {counts['figures']} figures; real within {FIDELITY_TOLERANCE:.0%} of itself"
        f" between its rounds (largest over smallest): {counts['real_rounds_within']} of"
        f" {counts['real_round_pairs']}"
    )
    return compared


def measure(args: argparse.Namespace) -> dict[str, Any]:
    handover = any(config in PD_CONFIGS for config in args.configs)
    profile = args.profile or fit_profile(args.out, args.fit_cores, handover, args.spend)
    if args.fit_handover_cpu:
        # The same profile with and without the host's share, against the same real runs.
        args.profile_b = args.out / f"{profile.stem}-host-cpu.yaml"
        load_profile(str(profile)).save(args.profile_b)
        fit_handover_cpu(args.profile_b)
    console.print(f"profile: {profile}")
    if args.offline_only:
        # The served rows of an earlier run, the offline ones computed again.
        earlier = json.loads((args.out / "sim_fidelity.json").read_text())["runs"]
        rows = [row for row in earlier if row["kind"] != "offline"]
        for config in args.configs:
            rows += offline_rows(config, profile, 0, args)
    else:
        rows = run_rounds(args, profile)
    return {
        "profile": str(profile),
        "args": {k: str(v) for k, v in vars(args).items()},
        "runs": rows,
        **tables(rows),
    }


def tables(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The cells compared, with the second profile's (cells_b) where it ran, and each
    one's figures against the real spread (spread, spread_b)."""
    spread = real_spread(rows)
    rounds = len({row["round"] for row in rows if row["kind"] == "real"})
    compared: dict[str, list[dict[str, Any]]] = {}
    for suffix, kind in (("", SIMULATED), ("_b", SIMULATED_B)):
        if any(row["kind"] == kind for row in rows):
            cells = print_table(rows, kind)
            compared[f"cells{suffix}"] = cells
            compared[f"spread{suffix}"] = spread_figures(cells, spread)
            print_spread(compared[f"spread{suffix}"], rounds, kind)
    if any(row["kind"] == "offline" for row in rows):  # what the advisor answers from
        compared["spread_offline"] = spread_figures(over_real(rows, "offline"), spread)
        print_spread(compared["spread_offline"], rounds, "offline")
    return compared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="single")
    parser.add_argument("--workloads", default="general,prefill-heavy,decode-heavy")
    parser.add_argument("--rates", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument(
        "--trace",
        choices=("burstgpt", "burstgpt-synthetic"),
        default="burstgpt-synthetic",
        help="where the T-* workloads' rows come from: BurstGPT's CSV (downloaded once)"
        " or its synthetic stand-in",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=Path, help="a fitted profile; default: fit one first")
    parser.add_argument(
        "--profile-b",
        type=Path,
        help="a second profile, served in the same rounds (kind simulated_b): an A/B of two"
        " profiles against the same real runs",
    )
    parser.add_argument(
        "--fit-handover-cpu",
        action="store_true",
        help="measure the host CPU a hand-over costs (fit_handover_cpu) on a copy of"
        " --profile in --out, and serve that copy as --profile-b",
    )
    parser.add_argument(
        "--fit-cores",
        type=int,
        choices=(1, 2),
        default=2,
        help="fit on an engine with both cores (single.yaml) or one (dp, pd_always, auto)",
    )
    parser.add_argument(
        "--spend",
        choices=("wall", "cpu"),
        default="wall",
        help="the simulated engines' engine.spend: sleep each step (wall), or compute it on"
        " the engine's cores (cpu), sharing them with the router and client as the real"
        " engine does",
    )
    parser.add_argument(
        "--offline-only",
        action="store_true",
        help="keep --out's served runs, run the offline cells again",
    )
    parser.add_argument(
        "--tables-only",
        action="store_true",
        help="serve nothing: print --out's saved runs again (and save their cells)",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "sim_fidelity")
    args = parser.parse_args()
    args.configs = args.configs.split(",")
    args.workloads = args.workloads.split(",")
    args.rates = [float(rate) for rate in args.rates.split(",")]
    args.out = args.out.resolve()  # the profile command runs in the repository
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "sim_fidelity.json"
    if args.tables_only:
        result = json.loads(path.read_text())
        result.update(tables(result["runs"]))
    else:
        result = measure(args)
    path.write_text(json.dumps(result, indent=1))
    console.print(f"saved {path}")


if __name__ == "__main__":
    main()
