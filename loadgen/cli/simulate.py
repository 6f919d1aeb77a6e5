"""``python -m loadgen simulate``: a run in virtual time on simulated engines."""

from __future__ import annotations

import argparse

from rich.console import Console

from loadgen.cli.common import (
    configure_logging,
    out_dir,
    report_runs,
    run_config,
    workload_config,
)
from loadgen.cli.run import build_parser
from loadgen.data.workloads import load_trace
from loadgen.scheduling.eventloop import run_event_loop
from loadgen.scheduling.runner import RunResult
from loadgen.study.simulate import SimulatedTarget, simulate_run
from loadgen.vllm_compat.cli import (
    resolve,
)


def build_simulate_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    parser.prog = "python -m loadgen simulate"
    parser.description = (
        "A run's results without a server: the same workload, prompts and schedule, served"
        " offline in virtual time by the config's router decisions over simulated engines"
        " that keep a latency profile's time (python -m deployments.simulate)."
    )
    parser.add_argument("config", help="single, dp, pd, pd_always, auto, ... or a YAML path")
    parser.add_argument(
        "--latency-profile",
        required=True,
        help="a latency profile file or a shipped one (python -m loadgen profile --list);"
        " --profile is vLLM's flag for its torch profiler",
    )
    parser.add_argument(
        "--path-ms",
        type=float,
        default=0.0,
        help="what the serving path (HTTP, parsing, tokenization) costs each request before"
        " it is planned; virtual time has none of it (measure it with python -m loadgen"
        " profile against the path on zero-time engines)",
    )
    return parser


def command_simulate(argv: list[str], console: Console) -> int:
    args = build_simulate_parser().parse_args(argv)
    configure_logging(args.verbose)
    vllm = resolve(args)
    workload = vllm.workload or workload_config(args, args.workload)
    if workload.is_trace:
        load_trace(workload)
    configs = [run_config(args, workload, qps, vllm.run_fields) for qps in args.qps]
    if workload.is_replay and len(configs) > 1:
        configs = configs[:1]
    target = SimulatedTarget(args.config, args.latency_profile, args.model, args.path_ms)
    out = out_dir(args, "simulate")

    async def all_runs() -> list[RunResult]:
        return [await simulate_run(config, target, console) for config in configs]

    report_runs(run_event_loop(all_runs()), out, args, vllm, console)
    return 0
