"""``python -m loadgen sweep``: the study's matrix, shapes x workloads x rates."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from rich.console import Console

from loadgen.cli.common import (
    add_load_options,
    add_report_options,
    add_run_target_options,
    add_shape_flag,
    add_workload_options,
    configure_logging,
    exposition_of,
    name_list,
    out_dir,
    run_config,
    url_map,
    workload_config,
)
from loadgen.scheduling.eventloop import run_event_loop
from loadgen.study.sweep import (
    SMOKE_QPS,
    SMOKE_REQUESTS,
    SMOKE_WARMUP_REQUESTS,
    SMOKE_WORKLOADS,
    STUDY_QPS,
    STUDY_SHAPES,
    STUDY_WORKLOADS,
    SweepConfig,
    run_sweep,
)

SWEEP_EXAMPLES = """examples:
  # the study's whole matrix: starts and stops python -m deployments.serve <shape> per shape
  python -m loadgen sweep --shapes tp,pp,dp,pd_always --qps 1,2,4,8,inf --trace-file BurstGPT_1.csv
  # a few minutes on a laptop: 10 requests a cell, QPS 4 and inf, synthetic trace
  python -m loadgen sweep --smoke --shapes dp,tp
  # servers that are already up
  python -m loadgen sweep --urls tp=http://10.0.0.5:8000,dp=http://10.0.0.6:8000"""


def build_sweep_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen sweep",
        description="The study's matrix: shapes x workloads x QPS; starts and stops each"
        " Serve application (python -m deployments.serve <shape>) unless given --urls.",
        epilog=SWEEP_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    matrix = parser.add_argument_group("matrix")
    add_shape_flag(matrix, "--shapes", type=name_list, default=list(STUDY_SHAPES))

    matrix.add_argument("--workloads", type=name_list, help=f"default: {','.join(STUDY_WORKLOADS)}")
    matrix.add_argument(
        "--smoke",
        action="store_true",
        help=f"{SMOKE_REQUESTS} requests a cell, QPS 4,inf, synthetic trace",
    )
    matrix.add_argument("--urls", type=url_map, default={}, help="SHAPE=URL,...: do not launch")
    matrix.add_argument(
        "--launch-command",
        help="instead of serve run: a command template with {shape} {config} {port}",
    )
    matrix.add_argument("--deployments-dir", type=Path, help="where <shape>.yaml files are")
    matrix.add_argument("--port", type=int, default=8000, help="port of launched servers")
    matrix.add_argument("--ready-timeout", type=float, default=600.0)
    matrix.add_argument("--stop-timeout", type=float, default=120.0)
    matrix.add_argument("--figure-qps", type=float, default=8.0, help="QPS of Figure 1's bars")
    add_run_target_options(parser)
    add_workload_options(parser, single=False)
    add_load_options(parser, ",".join("inf" if math.isinf(q) else f"{q:g}" for q in STUDY_QPS))
    add_report_options(parser)
    return parser


def command_sweep(argv: list[str], console: Console) -> int:
    args = build_sweep_parser().parse_args(argv)
    configure_logging(args.verbose)
    explicit = set(argv)
    workloads = args.workloads or list(SMOKE_WORKLOADS if args.smoke else STUDY_WORKLOADS)
    qps = args.qps
    if args.smoke:
        qps = qps if "--qps" in explicit else list(SMOKE_QPS)
        if "--num-requests" not in explicit:
            args.num_requests = SMOKE_REQUESTS
        if "--warmup-requests" not in explicit:
            args.warmup_requests = SMOKE_WARMUP_REQUESTS
        if args.trace is None and args.trace_file is None:
            args.trace = "burstgpt-synthetic"
    shapes = args.shapes if "--shapes" in explicit or not args.urls else list(args.urls)
    sweep_fields: dict[str, object] = {
        "shapes": shapes,
        "workloads": workloads,
        "qps": qps,
        "urls": args.urls,
        "launch_command": args.launch_command,
        "port": args.port,
        "ready_timeout_s": args.ready_timeout,
        "stop_timeout_s": args.stop_timeout,
        "figure_qps": args.figure_qps,
        "out_dir": out_dir(args, "sweep"),
        "plots_per_run": not args.no_plots,
    }
    if args.deployments_dir is not None:
        sweep_fields["deployments_dir"] = args.deployments_dir
    sweep = SweepConfig.model_validate(sweep_fields)
    base = run_config(args, workload_config(args, workloads[0]), qps[0])
    exposition = exposition_of(args, console)
    result = run_event_loop(run_sweep(sweep, base, console, exposition))
    for name, path in result.outputs.items():
        console.print(f"{name}: {path}")
    for shape, error in result.failures.items():
        console.print(f"[red]not measured: {shape}[/] ({error.splitlines()[0]})")
    return 1 if result.failures and not result.rows else 0
