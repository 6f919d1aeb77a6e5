"""``python -m loadgen report``: the dashboard's key panels as PNG, without Grafana.

From a run's JSON (``write_run_json``): latency distributions (TTFT, ITL, TPOT, E2E),
the client's throughput, in-flight requests and TTFT over the run (1 s bins, from every
request's timestamps), and the server's view (utilization per GPU or engine process,
KV cache usage per replica, prefill place, requests by status). From a sweep's folder:
the study's figures from ``sweep.csv`` plus the panels of every run in ``runs/``.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen.outputs.report import _cdf, _pyplot, plot_figure1, plot_sweep_by_qps

BIN_S = 1.0  # timeline resolution: one point per second, like a 1 s scrape
TEXT_COLUMNS = ("run_id", "shape", "workload", "qps", "gpu_utilization_per_gpu")


class ReportError(ValueError):
    """The path is neither a run's JSON nor a folder with runs or a sweep."""


def render_report(path: Path, out_dir: Path | None = None) -> list[Path]:
    """PNG files for a run JSON, a folder of them, or a sweep's output folder."""
    if path.is_file():
        return [
            plot_run_panels(load_run(path), (out_dir or path.parent) / f"{path.stem}.panels.png")
        ]
    if not path.is_dir():
        raise ReportError(f"no such file or folder: {path}")
    out_dir = out_dir or path
    written = []
    sweep_csv = path / "sweep.csv"
    if sweep_csv.exists():
        rows = read_rows(sweep_csv)
        if rows:
            qps = _figure_qps(rows)
            written.append(plot_figure1(rows, out_dir / f"figure1_qps{qps}.png", qps))
            written.append(plot_sweep_by_qps(rows, out_dir / "sweep_by_qps.png"))
    runs = sorted((path / "runs").glob("*.json")) or sorted(path.glob("*.json"))
    for run in runs:
        written.append(plot_run_panels(load_run(run), out_dir / f"{run.stem}.panels.png"))
    if not written:
        raise ReportError(f"{path} holds no run JSON and no sweep.csv")
    return written


def load_run(path: Path) -> dict[str, Any]:
    document = json.loads(path.read_text())
    if not isinstance(document, dict) or "requests" not in document:
        raise ReportError(f"{path} is not a load generator run (no 'requests')")
    return document


def read_rows(path: Path) -> list[dict[str, Any]]:
    """sweep.csv back into rows: numbers as floats, empty cells as NaN."""
    with path.open(newline="") as file:
        return [
            {key: value if key in TEXT_COLUMNS else _number(value) for key, value in row.items()}
            for row in csv.DictReader(file)
        ]


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def _figure_qps(rows: Sequence[dict[str, Any]]) -> str:
    labels = [str(r["qps"]) for r in rows if r["qps"] != "replay"]
    return max(set(labels), key=labels.count) if labels else "replay"


def _measured(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in document["requests"] if not r["warmup"]]


def timeline(requests: Sequence[dict[str, Any]], bin_s: float = BIN_S) -> dict[str, list[float]]:
    """Per bin: completed requests/s, output tokens/s, requests in flight at the bin's start."""
    if not requests:
        return {"t": [], "completed": [], "tokens": [], "in_flight": []}
    end = max(r["done_s"] for r in requests)
    bins = max(1, math.ceil(end / bin_s))
    completed, tokens = [0.0] * bins, [0.0] * bins
    for r in requests:
        index = min(int(r["done_s"] / bin_s), bins - 1)
        if r["outcome"] == "ok":
            completed[index] += 1 / bin_s
            tokens[index] += r["output_tokens"] / bin_s
    starts = [i * bin_s for i in range(bins)]
    in_flight = [float(sum(1 for r in requests if r["sent_s"] <= t < r["done_s"])) for t in starts]
    return {"t": starts, "completed": completed, "tokens": tokens, "in_flight": in_flight}


def plot_run_panels(document: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    requests = _measured(document)
    done = [r for r in requests if r["outcome"] == "ok"]
    figure, axes = plt.subplots(3, 3, figsize=(17, 11))
    _cdf(axes[0][0], [r["ttft_s"] for r in done if r["ttft_s"] is not None], "TTFT")
    _cdf(axes[0][1], [g for r in done for g in r["itl_s"]], "ITL (to p99.5)", clip_tail=True)
    _cdf(axes[0][2], [r["e2e_s"] for r in done if r["e2e_s"] is not None], "E2E")
    _plot_timeline(axes[1][0], axes[1][1], timeline(requests))
    _plot_ttft_over_time(axes[1][2], done)
    server = document.get("server") or {}
    _plot_utilization(axes[2][0], server)
    _plot_kv_usage(axes[2][1], server)
    _plot_outcomes(axes[2][2], server, requests)
    row = document.get("summary_row", {})
    figure.suptitle(
        f"{document['run_id']}: {row.get('completed', len(done))} done,"
        f" {_fmt(row.get('request_throughput'))} req/s,"
        f" {_fmt(row.get('output_token_throughput'))} output tok/s"
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else "?"


def _plot_timeline(throughput: Any, in_flight: Any, series: dict[str, list[float]]) -> None:
    throughput.plot(series["t"], series["completed"], marker=".", label="completed req/s")
    tokens = throughput.twinx()
    tokens.plot(
        series["t"], series["tokens"], color="tab:orange", linestyle="--", label="output tok/s"
    )
    throughput.legend(
        [*throughput.get_lines(), *tokens.get_lines()],
        ["completed req/s", "output tok/s"],
        loc="upper left",
    )
    throughput.set_xlabel("time (s from start)")
    throughput.set_ylabel("requests/s")
    tokens.set_ylabel("output tokens/s")
    throughput.set_title("client throughput")
    throughput.grid(alpha=0.3)
    in_flight.step(series["t"], series["in_flight"], where="post")
    in_flight.set_xlabel("time (s from start)")
    in_flight.set_ylabel("requests in flight")
    in_flight.set_title("client in flight")
    in_flight.grid(alpha=0.3)


def _plot_ttft_over_time(axis: Any, done: Sequence[dict[str, Any]]) -> None:
    axis.scatter([r["sent_s"] for r in done], [1000 * (r["ttft_s"] or 0) for r in done], s=6)
    axis.set_xlabel("send time (s from start)")
    axis.set_ylabel("TTFT (ms)")
    axis.set_title("TTFT over the run")
    axis.grid(alpha=0.3)


def _bars(axis: Any, values: dict[str, float], title: str, ylabel: str) -> None:
    axis.set_title(title)
    axis.set_ylabel(ylabel)
    if not values:
        axis.text(0.5, 0.5, "not exported", ha="center", transform=axis.transAxes)
        return
    axis.bar(list(values), list(values.values()))
    axis.tick_params(axis="x", rotation=20)
    axis.grid(axis="y", alpha=0.3)


def _plot_utilization(axis: Any, server: dict[str, Any]) -> None:
    per_gpu = server.get("gpu_utilization_pct") or {}
    if per_gpu:
        imbalance = server.get("gpu_imbalance_pct")
        _bars(axis, per_gpu, f"GPU utilization (imbalance {_fmt(imbalance)} %)", "percent")
        return
    # No GPU: whatever else the server exported as *_utilization_percent (engine CPU).
    other = {
        f"{name.removeprefix('splitserve_').removesuffix('_utilization_percent')} {key}": value
        for name, by_key in (server.get("other_utilization_pct") or {}).items()
        for key, value in by_key.items()
    }
    _bars(axis, other, "utilization (no GPU metrics)", "percent")


def _plot_kv_usage(axis: Any, server: dict[str, Any]) -> None:
    usage = {k: 100 * v for k, v in (server.get("kv_cache_usage_mean") or {}).items()}
    _bars(axis, usage, "KV cache usage, mean per replica", "percent")


def _plot_outcomes(axis: Any, server: dict[str, Any], requests: Sequence[dict[str, Any]]) -> None:
    counts: dict[str, float] = {}
    for r in requests:
        counts[f"client {r['outcome']}"] = counts.get(f"client {r['outcome']}", 0) + 1
    for where in ("local", "remote"):
        if server.get(f"prefill_{where}") is not None:
            counts[f"prefill {where}"] = server[f"prefill_{where}"]
    if server.get("rejections") is not None:
        counts["server rejections"] = server["rejections"]
    _bars(axis, counts, "outcomes and prefill place", "requests")
