"""``python -m loadgen knee``: the highest rate that meets the objectives."""

from __future__ import annotations

import argparse

from rich.console import Console

from loadgen.cli.common import (
    add_load_options,
    add_report_options,
    add_run_target_options,
    add_workload_options,
    configure_logging,
    out_dir,
    run_config,
    workload_config,
)
from loadgen.outputs.report import (
    plot_knee,
    print_knee,
    write_knee,
    write_run_json,
)
from loadgen.scheduling.eventloop import run_event_loop
from loadgen.scheduling.runner import execute_run
from loadgen.study import knee


def build_knee_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen knee",
        description=knee.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_target_options(parser)
    add_workload_options(parser)
    add_load_options(parser, "1")
    add_report_options(parser)
    group = parser.add_argument_group("search")
    defaults = knee.KneeSearchConfig()
    group.add_argument(
        "--attainment",
        type=float,
        default=defaults.attainment,
        help="share of requests that must meet every SLO",
    )
    group.add_argument("--qps-start", type=float, default=defaults.qps_start)
    group.add_argument("--qps-max", type=float, default=defaults.qps_max)
    group.add_argument("--tolerance", type=float, default=defaults.tolerance)
    group.add_argument("--max-steps", type=int, default=defaults.max_steps)
    return parser


def command_knee(argv: list[str], console: Console) -> int:
    args = build_knee_parser().parse_args(argv)
    configure_logging(args.verbose)
    if args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        raise ValueError(
            "the knee is where the SLOs stop being met: give --slo-ttft-ms and/or --slo-tpot-ms"
        )
    search = knee.KneeSearchConfig(
        attainment=args.attainment,
        qps_start=args.qps_start,
        qps_max=args.qps_max,
        tolerance=args.tolerance,
        max_steps=args.max_steps,
    )
    workload = workload_config(args, args.workload)
    out = out_dir(args, "knee")
    args.no_progress = True  # one line per step instead

    async def run_at(qps: float) -> knee.KneeStep:
        result = await execute_run(run_config(args, workload, qps), console)
        write_run_json(result, out)
        step = knee.step_of(qps, result.summary)
        console.print(
            f"qps {qps:g}: {100 * step.attainment:.0f}% met the SLOs,"
            f" goodput {step.goodput:.2f} req/s"
        )
        return step

    result = run_event_loop(knee.find_knee(run_at, search))
    print_knee(console, result)
    console.print(f"knee: {write_knee(result, out)}")
    if not args.no_plots:
        console.print(f"plot: {plot_knee(result, out / 'knee.png')}")
    return 0
