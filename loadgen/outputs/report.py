"""Reports: the console table, JSON (every request), CSV (one row per run), PNG plots.

A run's row is a flat dict (``summary_row``), shared by the console table, the CSV
and the sweep's table and figures, so they cannot disagree.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadgen.scheduling.runner import RunResult
from loadgen.study.knee import KneeResult

LATENCY_FIELDS = ("mean", "p50", "p90", "p95", "p99")
SWEEP_TABLE_COLUMNS = (
    ("shape", "shape"),
    ("workload", "workload"),
    ("qps", "QPS"),
    ("completed", "done"),
    ("request_throughput", "req/s"),
    ("total_token_throughput", "total tok/s"),
    ("ttft_mean_ms", "TTFT mean ms"),
    ("ttft_p95_ms", "TTFT p95 ms"),
    ("itl_mean_ms", "ITL mean ms"),
    ("itl_p95_ms", "ITL p95 ms"),
    ("gpu_utilization_mean_pct", "GPU util %"),
    ("gpu_imbalance_pct", "GPU imbalance %"),
)
QPS_ORDER = ("1", "2", "4", "8", "inf", "replay")


def summary_row(result: RunResult) -> dict[str, Any]:
    """The flat summary of a run (CSV columns, table cells, figure points)."""
    s = result.summary
    server = result.server
    row: dict[str, Any] = {
        "run_id": result.run_id,
        "shape": result.shape,
        "workload": result.workload.label,
        "qps": result.qps_label,
        "requests": s.requests,
        "completed": s.completed,
        "rejected": s.rejected,
        "errors": s.errors,
        "duration_s": s.duration_s,
        "request_throughput": s.request_throughput,
        "output_token_throughput": s.output_token_throughput,
        "total_token_throughput": s.total_token_throughput,
    }
    for name, distribution in (("ttft", s.ttft), ("itl", s.itl), ("tpot", s.tpot), ("e2e", s.e2e)):
        row.update({f"{name}_{k}_ms": v for k, v in distribution.ms().items()})
    row.update(
        {
            "send_lag_p50_ms": s.send_lag.p50 * 1000,
            "send_lag_p99_ms": s.send_lag.p99 * 1000,
            "goodput": s.goodput,
            "slo_attainment": s.slo_attainment,
            "length_mismatches": s.length_mismatches,
            "gpu_utilization_mean_pct": server.gpu_utilization_mean_pct,
            "gpu_imbalance_pct": server.gpu_imbalance_pct,
            "gpu_utilization_per_gpu": " ".join(
                f"{gpu}:{value:.1f}" for gpu, value in server.gpu_utilization_pct.items()
            )
            or None,
            "kv_cache_usage_max": max(server.kv_cache_usage_max.values(), default=None),
            "prefill_local": server.prefill_local,
            "prefill_remote": server.prefill_remote,
            "prefill_s_per_token": _pool_figure(server.prefill_s_per_token, "prefill"),
            "decode_step_s": _pool_figure(server.decode_step_s, "decode"),
            "kv_transfer_s_per_mib": server.kv_transfer_s_per_mib,
            "server_rejections": server.rejections,
            "model": result.model,
            "trace_source": result.workload.source,
            "synthetic_trace": result.workload.synthetic_trace,
        }
    )
    return row


def _pool_figure(by_replica: dict[str, float], role: str) -> float | None:
    """The mean over a pool's replicas (``prefill-0``...), or over all when no such pool."""
    values = [v for name, v in by_replica.items() if name.startswith(f"{role}-")]
    values = values or list(by_replica.values())
    return sum(values) / len(values) if values else None


def _cell(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


# ---- console --------------------------------------------------------------------------------


RUN_TABLE_ROWS: tuple[tuple[str, str, int], ...] = (
    ("requests", "sent", 0),
    ("completed", "done", 0),
    ("rejected", "rejected", 0),
    ("errors", "errors", 0),
    ("request_throughput", "req/s", 2),
    ("output_token_throughput", "output tok/s", 1),
    ("total_token_throughput", "total tok/s", 1),
    *((f"ttft_{k}_ms", f"TTFT {k} (ms)", 1) for k in LATENCY_FIELDS),
    *((f"itl_{k}_ms", f"ITL {k} (ms)", 2) for k in LATENCY_FIELDS),
    ("tpot_mean_ms", "TPOT mean (ms)", 2),
    *((f"e2e_{k}_ms", f"E2E {k} (ms)", 1) for k in ("mean", "p50", "p95", "p99")),
    ("goodput", "goodput (req/s)", 2),
    ("slo_attainment", "SLO attainment", 3),
    ("send_lag_p99_ms", "send lag p99 (ms)", 2),
    ("gpu_utilization_mean_pct", "GPU util mean (%)", 1),
    ("gpu_imbalance_pct", "GPU imbalance (%)", 1),
    ("gpu_utilization_per_gpu", "GPU util per GPU (%)", 0),
    ("kv_cache_usage_max", "KV cache max", 2),
    ("prefill_local", "prefill local", 0),
    ("prefill_remote", "prefill remote", 0),
    ("server_rejections", "server rejections", 0),
)


def print_run_table(console: Console, results: Sequence[RunResult]) -> None:
    """One column per run, one row per figure: narrow enough for a terminal."""
    table = Table(title="loadgen results")
    table.add_column("")
    rows = [summary_row(result) for result in results]
    for row in rows:
        table.add_column(f"{row['shape']}\n{row['workload']}\nQPS {row['qps']}", justify="right")
    for key, label, digits in RUN_TABLE_ROWS:
        if all(row.get(key) is None for row in rows):
            continue  # e.g. goodput without SLOs, server figures it does not export
        table.add_row(label, *(_cell(row.get(key), digits) for row in rows))
    console.print(table)
    for result in results:
        for note in [*result.notes, *result.server.notes]:
            console.print(f"[yellow]{result.run_id}[/]: {note}")
        if result.workload.synthetic_trace:
            console.print(f"[yellow]{result.run_id}[/]: SYNTHETIC trace ({result.workload.source})")
        failures = result.summary.failures_by_status
        if failures:
            console.print(f"{result.run_id}: failures by status {failures}")


# ---- files --------------------------------------------------------------------------------


def jsonable(value: Any) -> Any:
    """JSON without NaN/Infinity: NaN becomes null, infinities 'inf'/'-inf'."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def run_document(result: RunResult) -> dict[str, Any]:
    plan = result.workload
    mean_in, mean_out = plan.mean_lengths()
    return {
        "run_id": result.run_id,
        "started_at": result.started_at,
        "clock_origin_s": result.clock_origin_s,
        "shape": result.shape,
        "model": result.model,
        "max_model_len": result.max_model_len,
        "qps": result.qps_label,
        "arrivals": result.arrivals,
        "workload": {
            "name": plan.name,
            "label": plan.label,
            "source": plan.source,
            "synthetic_trace": plan.synthetic_trace,
            "mean_input_tokens": mean_in,
            "mean_output_tokens": mean_out,
        },
        "config": result.config.model_dump(mode="python"),
        "summary": asdict(result.summary),
        "summary_row": summary_row(result),
        "server": asdict(result.server),
        "chat_calibration": asdict(result.chat_calibration) if result.chat_calibration else None,
        "notes": result.notes,
        "requests": [m.to_json() for m in result.requests],
    }


def write_run_json(result: RunResult, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{result.run_id}.json"
    path.write_text(json.dumps(jsonable(run_document(result)), indent=1, allow_nan=False))
    return path


def write_summary_csv(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(rows[0]) if rows else []
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in jsonable(row).items()})
    return path


# ---- plots ---------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(axis: Any, values: Sequence[float], label: str, clip_tail: bool = False) -> None:
    import numpy as np

    if not values:
        axis.text(0.5, 0.5, "no samples", ha="center", transform=axis.transAxes)
        return
    ordered = np.sort(np.asarray(values) * 1000)
    axis.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered))
    axis.set_xlabel(f"{label} (ms)")
    axis.set_ylabel("fraction of samples")
    axis.grid(alpha=0.3)
    if clip_tail and ordered[-1] > 0:
        # A few long gaps (a preemption, a GC pause) would squash the rest against zero.
        axis.set_xlim(0, max(float(np.percentile(ordered, 99.5)) * 1.2, 1e-3))


def plot_run(result: RunResult, path: Path) -> Path:
    """TTFT, ITL and E2E distributions, and TTFT over the run."""
    plt = _pyplot()
    done = [m for m in result.requests if not m.warmup and m.outcome == "ok"]
    failed = [m for m in result.requests if not m.warmup and m.outcome != "ok"]
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    _cdf(axes[0][0], [m.ttft_s for m in done if m.ttft_s is not None], "TTFT")
    _cdf(axes[0][1], [g for m in done for g in m.itl_s], "ITL (to p99.5)", clip_tail=True)
    _cdf(axes[1][0], [m.e2e_s for m in done if m.e2e_s is not None], "E2E")
    timeline = axes[1][1]
    ttfts_ms = [(m.ttft_s or 0.0) * 1000 for m in done]
    timeline.scatter([m.sent_s for m in done], ttfts_ms, s=6, label="ok")
    if failed:
        sent = [m.sent_s for m in failed]
        timeline.scatter(sent, [0] * len(failed), s=12, marker="x", c="red", label="rejected/error")
    timeline.set_xlabel("send time (s from start)")
    timeline.set_ylabel("TTFT (ms)")
    timeline.grid(alpha=0.3)
    timeline.legend()
    synthetic = " [SYNTHETIC trace]" if result.workload.synthetic_trace else ""
    figure.suptitle(f"{result.run_id}{synthetic}")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _qps_key(label: str) -> tuple[int, float]:
    if label in QPS_ORDER:
        return (QPS_ORDER.index(label), 0.0)
    try:
        return (len(QPS_ORDER), float(label))
    except ValueError:
        return (len(QPS_ORDER) + 1, 0.0)


def plot_figure1(rows: Sequence[dict[str, Any]], path: Path, qps: str) -> Path:
    """The study's Figure 1: throughput and TTFT p95 per shape and workload at one QPS."""
    import numpy as np

    plt = _pyplot()
    chosen = [r for r in rows if r["qps"] in (qps, "replay") and r.get("completed")]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    figure, axes = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(workloads)), 4.5))
    width = 0.8 / max(len(shapes), 1)
    metrics = (
        ("request_throughput", "(a) request throughput (req/s)"),
        ("ttft_p95_ms", "(b) TTFT p95 (ms)"),
    )
    for axis, (key, title) in zip(axes, metrics, strict=True):
        for index, shape in enumerate(shapes):
            values = [
                next((r[key] for r in chosen if r["shape"] == shape and r["workload"] == w), np.nan)
                for w in workloads
            ]
            positions = np.arange(len(workloads)) + index * width
            axis.bar(positions, values, width, label=shape)
        axis.set_xticks(np.arange(len(workloads)) + width * (len(shapes) - 1) / 2)
        axis.set_xticklabels(workloads, rotation=20, ha="right")
        axis.set_title(title)
        axis.grid(axis="y", alpha=0.3)
    axes[0].legend(title="shape")
    figure.suptitle(f"Figure 1: per shape and workload at QPS {qps} (T-burst-replay: its trace)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_sweep_by_qps(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Throughput and TTFT p95 against QPS, one panel per workload, one line per shape."""
    plt = _pyplot()
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    figure, axes = plt.subplots(
        2, max(len(workloads), 1), figsize=(3.6 * max(len(workloads), 1), 6.5), squeeze=False
    )
    for column, workload in enumerate(workloads):
        for row_index, (key, label) in enumerate(
            (("request_throughput", "req/s"), ("ttft_p95_ms", "TTFT p95 (ms)"))
        ):
            axis = axes[row_index][column]
            for shape in shapes:
                points = sorted(
                    (r for r in rows if r["shape"] == shape and r["workload"] == workload),
                    key=lambda r: _qps_key(r["qps"]),
                )
                qps = [r["qps"] for r in points]
                axis.plot(qps, [r[key] for r in points], marker="o", label=shape)
            axis.set_title(workload if row_index == 0 else "")
            axis.set_xlabel("QPS")
            axis.set_ylabel(label)
            axis.grid(alpha=0.3)
    axes[0][0].legend(title="shape")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


# ---- the sweep's table -------------------------------------------------------------------


def print_sweep_table(console: Console, rows: Sequence[dict[str, Any]]) -> None:
    table = Table(title="the study's table: per shape, workload and QPS")
    for _, header in SWEEP_TABLE_COLUMNS:
        table.add_column(header, justify="left" if header in ("shape", "workload") else "right")
    for row in rows:
        table.add_row(
            *(_cell(row.get(key), 2 if "itl" in key else 1) for key, _ in SWEEP_TABLE_COLUMNS)
        )
    console.print(table)


def write_sweep_markdown(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    lines = [
        "| " + " | ".join(header for _, header in SWEEP_TABLE_COLUMNS) + " |",
        "|" + "---|" * len(SWEEP_TABLE_COLUMNS),
    ]
    for row in rows:
        cells = (_cell(row.get(key), 2 if "itl" in key else 1) for key, _ in SWEEP_TABLE_COLUMNS)
        lines.append("| " + " | ".join(cells) + " |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def print_trace_stats(
    console: Console,
    source: str,
    rows: int,
    means: dict[str, tuple[int, float, float]],
    study: dict[str, tuple[int, int]],
) -> None:
    table = Table(title=f"BurstGPT subsets of {source} ({rows} rows after filters)")
    for header in ("subset", "rows", "mean in", "mean out", "study in/out (Table 2)"):
        table.add_column(header)
    for name, (count, mean_in, mean_out) in means.items():
        target = study.get(name)
        table.add_row(
            name,
            str(count),
            _cell(mean_in, 0),
            _cell(mean_out, 0),
            f"{target[0]}/{target[1]}" if target else "-",
        )
    console.print(table)


# ---- the knee (python -m loadgen knee) ---------------------------------------------------


def print_knee(console: Console, result: KneeResult) -> None:
    target = result.config["attainment"]
    table = Table(title=f"goodput search: {100 * target:.0f}% of requests within the SLOs")
    for column in ("req/s offered", "met SLOs", "goodput", "throughput", "TTFT p50", "TPOT p50"):
        table.add_column(column, justify="right")
    knee = result.knee
    for step in result.curve:
        mark = " <- knee" if knee is not None and step.qps == knee.qps else ""
        table.add_row(
            f"{step.qps:.3g}{mark}",
            f"{100 * step.attainment:.0f}%",
            f"{step.goodput:.2f}",
            f"{step.request_throughput:.2f}",
            _cell(step.ttft_p50_s and 1000 * step.ttft_p50_s) + " ms",
            _cell(step.tpot_p50_s and 1000 * step.tpot_p50_s, 2) + " ms",
        )
    console.print(table)
    console.print(f"knee: {knee.qps:.3g} req/s" if knee else "knee: no rate tried met the target")


def write_knee(result: KneeResult, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "knee.json"
    path.write_text(json.dumps(jsonable(result.to_dict()), indent=1))
    return path


def plot_knee(result: KneeResult, path: Path) -> Path:
    plt = _pyplot()
    curve = result.curve
    figure, attainment_axis = plt.subplots(figsize=(7, 4))
    qps = [step.qps for step in curve]
    attainment_axis.plot(qps, [100 * s.attainment for s in curve], "o-", label="met SLOs (%)")
    attainment_axis.axhline(100 * result.config["attainment"], linestyle=":", color="grey")
    attainment_axis.set_xlabel("offered load (req/s)")
    attainment_axis.set_ylabel("requests within the SLOs (%)")
    goodput_axis = attainment_axis.twinx()
    goodput_axis.plot(qps, [s.goodput for s in curve], "s--", color="tab:green", label="goodput")
    goodput_axis.set_ylabel("goodput (req/s)")
    if result.knee is not None:
        attainment_axis.axvline(result.knee.qps, color="tab:red", alpha=0.5)
        attainment_axis.set_title(f"knee at {result.knee.qps:.3g} req/s")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
