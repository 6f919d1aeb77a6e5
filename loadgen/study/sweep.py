"""The study's matrix in one command: every shape x workload x QPS, 200 requests a cell.

For each shape the sweep starts the Serve application itself (``python -m
deployments.serve <shape>``, or ``--launch-command``), runs every workload at every
rate against it, and stops it before the next shape; or it measures servers that are
already up (``--urls tp=http://...``). Every cell of a shape uses the same seed, so
all shapes see the same requests at the same offsets. Results are written as they
come (one JSON and PNG per cell, the table CSV after every cell), so an interrupted
sweep keeps what it measured.

Outputs: ``sweep.csv`` (every column), ``table.md`` (the study's table: req/s, total
tok/s, TTFT, ITL, GPU utilization per cell), ``figure1.png`` (the study's Figure 1:
throughput and TTFT p95 per shape and workload at ``--figure-qps``) and
``sweep_by_qps.png`` (the same against every QPS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field
from rich.console import Console

from loadgen.config import RunConfig, StrictModel, WorkloadConfig
from loadgen.data.workloads import load_trace
from loadgen.outputs.exposition import Exposition
from loadgen.outputs.report import (
    plot_figure1,
    plot_run,
    plot_sweep_by_qps,
    print_sweep_table,
    summary_row,
    write_run_json,
    write_summary_csv,
    write_sweep_markdown,
)
from loadgen.scheduling.arrivals import format_qps
from loadgen.scheduling.runner import RunError, RunResult, execute_run
from loadgen.study.launcher import (
    DEFAULT_DEPLOYMENTS_DIR,
    DEFAULT_READY_TIMEOUT_S,
    DEFAULT_STOP_TIMEOUT_S,
    LaunchError,
    command_from_template,
    launched_server,
    serve_run_command,
)
from loadgen.vllm_compat.result import write_vllm_result

STUDY_SHAPES = ("tp", "pp", "dp", "pd_always")
STUDY_WORKLOADS = (
    "general",
    "prefill-heavy",
    "decode-heavy",
    "T-general",
    "T-prefill-heavy",
    "T-decode-heavy",
    "T-burst-replay",
)
STUDY_QPS = (1.0, 2.0, 4.0, 8.0, math.inf)
STUDY_FIGURE_QPS = 8.0
SMOKE_WORKLOADS = ("general", "prefill-heavy", "decode-heavy", "T-general")
SMOKE_QPS = (4.0, math.inf)
SMOKE_REQUESTS = 10
SMOKE_WARMUP_REQUESTS = 1


class SweepConfig(StrictModel):
    """The matrix and how to reach each shape's server."""

    shapes: list[str] = Field(default_factory=lambda: list(STUDY_SHAPES), min_length=1)
    workloads: list[str] = Field(default_factory=lambda: list(STUDY_WORKLOADS), min_length=1)
    qps: list[float] = Field(default_factory=lambda: list(STUDY_QPS), min_length=1)
    urls: dict[str, str] = Field(
        default_factory=dict, description="shape -> base URL of a server that is already up"
    )
    launch_command: str | None = Field(
        None, description="instead of serve run: a template with {shape}, {config}, {port}"
    )
    deployments_dir: Path = DEFAULT_DEPLOYMENTS_DIR
    port: int = Field(8000, gt=0, lt=65536)
    ready_timeout_s: float = Field(DEFAULT_READY_TIMEOUT_S, gt=0)
    stop_timeout_s: float = Field(DEFAULT_STOP_TIMEOUT_S, gt=0)
    figure_qps: float = STUDY_FIGURE_QPS
    out_dir: Path = Path("results/loadgen/sweep")
    plots_per_run: bool = True


@dataclass
class SweepResult:
    rows: list[dict[str, Any]] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    outputs: dict[str, Path] = field(default_factory=dict)


def cell_configs(sweep: SweepConfig, base: RunConfig, shape: str, base_url: str) -> list[RunConfig]:
    """The runs of one shape: every workload at every QPS (the replay once, at its own pace)."""
    configs = []
    for workload in sweep.workloads:
        workload_config = WorkloadConfig.model_validate(
            {**base.workload.model_dump(), "name": workload}
        )
        rates = [math.inf] if workload_config.is_replay else sweep.qps
        for qps in rates:
            fields = {**base.model_dump(), "workload": workload_config, "qps": qps}
            fields.update(shape=shape, base_url=base_url, run_name=None)
            configs.append(RunConfig.model_validate(fields))
    return configs


def check_workloads(sweep: SweepConfig, base: RunConfig) -> None:
    """Fail before starting any server if a trace workload has no trace."""
    workloads = [
        WorkloadConfig.model_validate({**base.workload.model_dump(), "name": name})
        for name in sweep.workloads
    ]
    traces = [workload for workload in workloads if workload.is_trace]
    if traces:
        load_trace(traces[0])  # every trace workload reads the same (filtered) trace


async def run_sweep(
    sweep: SweepConfig,
    base: RunConfig,
    console: Console,
    exposition: Exposition | None = None,
) -> SweepResult:
    check_workloads(sweep, base)
    result = SweepResult()
    runs_dir = sweep.out_dir / "runs"
    for shape in sweep.shapes:
        console.rule(f"[bold]shape {shape}")
        try:
            await _run_shape(sweep, base, shape, console, exposition, result, runs_dir)
        except (LaunchError, RunError) as error:
            result.failures[shape] = str(error)
            console.print(f"[red]shape {shape} failed:[/] {error}")
    _write_outputs(sweep, result, console)
    return result


async def _run_shape(
    sweep: SweepConfig,
    base: RunConfig,
    shape: str,
    console: Console,
    exposition: Exposition | None,
    result: SweepResult,
    runs_dir: Path,
) -> None:
    if shape in sweep.urls:
        await _run_cells(
            sweep, base, shape, sweep.urls[shape], console, exposition, result, runs_dir
        )
        return
    config_path = sweep.deployments_dir / f"{shape}.yaml"
    if sweep.launch_command is None and not config_path.exists():
        raise LaunchError(f"no {config_path}: shape {shape} has no Serve application to start")
    command = (
        command_from_template(
            sweep.launch_command, shape=shape, config=config_path, port=sweep.port
        )
        if sweep.launch_command
        else serve_run_command(config_path, sweep.port)
    )
    base_url = f"http://127.0.0.1:{sweep.port}"
    console.print(f"starting {' '.join(command)} (waiting for {base_url}/health)")
    with launched_server(
        command,
        base_url,
        sweep.out_dir / "logs" / f"server-{shape}.log",
        ready_timeout_s=sweep.ready_timeout_s,
        stop_timeout_s=sweep.stop_timeout_s,
    ):
        await _run_cells(sweep, base, shape, base_url, console, exposition, result, runs_dir)
        console.print(f"stopping shape {shape}")


async def _run_cells(
    sweep: SweepConfig,
    base: RunConfig,
    shape: str,
    base_url: str,
    console: Console,
    exposition: Exposition | None,
    result: SweepResult,
    runs_dir: Path,
) -> None:
    for config in cell_configs(sweep, base, shape, base_url):
        run = await execute_run(config, console, exposition)
        _save_cell(run, runs_dir, sweep.plots_per_run)
        result.rows.append(summary_row(run))
        write_summary_csv(result.rows, sweep.out_dir / "sweep.csv")
        s = run.summary
        console.print(
            f"  {run.run_id}: {s.completed}/{s.requests} done, {s.request_throughput:.2f} req/s,"
            f" TTFT p95 {s.ttft.p95 * 1000:.1f} ms, ITL mean {s.itl.mean * 1000:.2f} ms"
        )


def figure_qps(sweep: SweepConfig) -> str:
    """The study's QPS 8 when the sweep has it, else its highest finite rate."""
    if sweep.figure_qps in sweep.qps:
        return format_qps(sweep.figure_qps)
    finite = [q for q in sweep.qps if math.isfinite(q)]
    return format_qps(max(finite) if finite else math.inf)


def _save_cell(run: RunResult, runs_dir: Path, plot: bool) -> None:
    write_run_json(run, runs_dir)
    write_vllm_result(run, runs_dir)
    if plot:
        plot_run(run, runs_dir / f"{run.run_id}.png")


def _write_outputs(sweep: SweepConfig, result: SweepResult, console: Console) -> None:
    out = sweep.out_dir
    out.mkdir(parents=True, exist_ok=True)
    if result.failures:
        (out / "failures.txt").write_text(
            "".join(f"{shape}: {error}\n" for shape, error in result.failures.items())
        )
    if not result.rows:
        return
    result.outputs = {
        "csv": write_summary_csv(result.rows, out / "sweep.csv"),
        "table": write_sweep_markdown(result.rows, out / "table.md"),
        "figure1": plot_figure1(result.rows, out / "figure1.png", figure_qps(sweep)),
        "by_qps": plot_sweep_by_qps(result.rows, out / "sweep_by_qps.png"),
    }
    print_sweep_table(console, result.rows)
