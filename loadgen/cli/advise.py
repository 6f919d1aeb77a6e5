"""``python -m loadgen advise``: which shape, sized for a rate or a device budget."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from rich.console import Console

from loadgen.cli.common import (
    add_shape_flag,
    configure_logging,
    name_list,
    out_dir,
)
from loadgen.cli.sweep import command_sweep
from loadgen.config import (
    RunConfig,
    WorkloadConfig,
)
from loadgen.outputs.report import (
    write_run_json,
)
from loadgen.scheduling.eventloop import run_event_loop
from loadgen.study import advisor, placement
from loadgen.study.deployment_plan import DeployTarget
from loadgen.study.launcher import DEFAULT_DEPLOYMENTS_DIR
from loadgen.study.placement_advice import PlacementQuestion, advise_placement
from loadgen.study.simulate import SimulatedTarget, simulate_run
from loadgen.study.sizing import ModelDims, model_dims, read_model_config

ADVISE_SHAPES = ("single", "dp", "pd_always", "pd", "auto")


ADVISE_SMOKE_QPS = "1,2,4"


ADVISE_SMOKE_REQUESTS = 24


SEARCH_REQUESTS = 500


SEARCH_RUN_SECONDS = 20.0


def build_advise_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen advise",
        description=advisor.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--sweep", type=Path, help="a sweep's folder (with runs/*.json)")
    source.add_argument(
        "--simulate",
        metavar="PROFILE",
        help="measure nothing: run the --shapes' cells offline on simulated engines that keep"
        " this latency profile's time (a file, or a shipped family such as"
        " h100-llama-3.1-8b: each pool takes its TP x PP member); seconds, not minutes."
        " With --devices N: search every placement of N devices (shapes, parallel degrees,"
        " P:D ratios) for the highest goodput",
    )
    source.add_argument(
        "--smoke",
        action="store_true",
        help=f"run a small sweep first: {','.join(ADVISE_SHAPES)}, QPS {ADVISE_SMOKE_QPS},"
        f" {ADVISE_SMOKE_REQUESTS} requests a cell (minutes on the embedded model)",
    )
    add_shape_flag(
        parser,
        "--shapes",
        type=name_list,
        help=f"default: {','.join(ADVISE_SHAPES)}; a placement search:"
        f" {','.join(placement.SEARCH_SHAPES)}",
    )
    parser.add_argument("--workload", default="general", help="--smoke's workload")
    parser.add_argument("--trace", choices=("burstgpt", "burstgpt-synthetic", "recorded"))
    parser.add_argument("--trace-file", type=Path, help="with --trace recorded: the record")
    parser.add_argument("--input-len", type=int, help="a placement search: fixed prompt tokens")
    parser.add_argument("--output-len", type=int, help="a placement search: fixed output tokens")
    parser.add_argument("--qps", default=ADVISE_SMOKE_QPS, help="--smoke's rates")
    parser.add_argument(
        "--num-requests",
        type=int,
        help=f"requests a run (default {ADVISE_SMOKE_REQUESTS}; a placement search"
        f" {SEARCH_REQUESTS})",
    )
    parser.add_argument(
        "--qps-start", type=float, default=1.0, help="a placement search's first rate"
    )
    parser.add_argument(
        "--run-seconds",
        type=float,
        default=SEARCH_RUN_SECONDS,
        help="a placement search: each run's arrivals span this long, so that a high rate"
        " reaches steady state (at least --num-requests requests)",
    )
    parser.add_argument("--slo-ttft-ms", type=float, help="time-to-first-token objective")
    parser.add_argument("--slo-tpot-ms", type=float, help="time-per-output-token objective")
    parser.add_argument(
        "--attainment",
        type=float,
        default=0.9,
        help="share of requests that must meet the objectives",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="--smoke: run every cell this many times"
    )
    parser.add_argument("--deployments-dir", type=Path, default=DEFAULT_DEPLOYMENTS_DIR)
    parser.add_argument("--yaml", type=Path, help="default: deployments/advised-<workload>.yaml")
    parser.add_argument(
        "--out", type=Path, help="report folder (default results/loadgen/advice-<time>)"
    )
    target = parser.add_argument_group("where the advised YAML runs")
    target.add_argument(
        "--target",
        choices=("cpu", "gpu"),
        help="gpu: accelerator gpu, the model's own dtype, no cpu_binds or kv_cache_gib"
        " (default: cpu; gpu for a placement search, whose profiles are GPUs')",
    )
    target.add_argument("--model", help="a Hugging Face id or local folder (default: the YAML's)")
    target.add_argument("--target-rate", type=float, help="size the pools for this many req/s")
    target.add_argument(
        "--devices", type=int, help="size for this many devices (default: as measured)"
    )
    target.add_argument("--devices-per-node", type=int, default=8, help="the largest TP degree")
    target.add_argument(
        "--device-memory-gib", type=float, default=80.0, help="memory of one device (GPU)"
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def command_advise(argv: list[str], console: Console) -> int:
    args = build_advise_parser().parse_args(argv)
    configure_logging(args.verbose)
    if args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        raise ValueError("advice needs objectives: give --slo-ttft-ms and/or --slo-tpot-ms")
    out = out_dir(args, "advice")
    if args.simulate and args.devices:
        return _placement_search(args, out, console)
    args.target = args.target or "cpu"
    args.shapes = args.shapes or list(ADVISE_SHAPES)
    args.num_requests = args.num_requests or ADVISE_SMOKE_REQUESTS
    sweep_dir = args.sweep
    if args.simulate:
        sweep_dir = out / "sweep"
        _simulated_sweep(args, sweep_dir / "runs", console)
    if args.smoke:
        sweep_dir = out / "sweep"
        for repeat in range(1, args.repeats + 1):
            folder = sweep_dir / f"repeat-{repeat}" if args.repeats > 1 else sweep_dir
            command_sweep(_advise_sweep_argv(args, folder), console)
    objectives = _objectives(args)
    points = advisor.load_points(sweep_dir, objectives)
    shapes = sorted({p.shape for p in points})
    layouts = {shape: advisor.layout_of(shape, args.deployments_dir) for shape in shapes}
    devices = {shape: layout.devices for shape, layout in layouts.items()}
    advice = advisor.advise(points, objectives, devices)
    target = DeployTarget(
        accelerator=args.target,
        model=args.model,
        rate=args.target_rate,
        devices=args.devices,
        devices_per_node=args.devices_per_node,
        device_gib=args.device_memory_gib,
    )
    # The model's weights against a device's memory size GPU engines only.
    shape = _model_dims(args.model, console) if args.target == "gpu" else None
    advisor.plan_for(advice, layouts, target, shape)
    slug = "".join(c if c.isalnum() else "-" for c in advice.workload).strip("-")
    yaml_path = args.yaml or args.deployments_dir / f"advised-{slug}.yaml"
    advisor.write_yaml(advice, args.deployments_dir, yaml_path, target)
    markdown, png = advisor.write_report(advice, out, yaml_path)
    console.print(markdown.read_text())
    console.print(f"YAML: {yaml_path}\nreport: {markdown}\nplot: {png}")
    return 0


def _objectives(args: argparse.Namespace) -> advisor.Objectives:
    return advisor.Objectives(
        ttft_s=args.slo_ttft_ms / 1000 if args.slo_ttft_ms is not None else None,
        tpot_s=args.slo_tpot_ms / 1000 if args.slo_tpot_ms is not None else None,
        attainment=args.attainment,
    )


def _placement_search(args: argparse.Namespace, out: Path, console: Console) -> int:
    """Every placement of --devices on the profile's degrees, searched offline."""
    if args.target_rate is not None:
        raise ValueError(
            "--target-rate sizes a measured shape; a placement search (--simulate with"
            " --devices) finds the most a budget of devices serves"
        )
    objectives = _objectives(args)
    question = PlacementQuestion(
        profile=args.simulate,
        devices=args.devices,
        run=RunConfig(
            workload=_advised_workload(args),
            num_requests=args.num_requests or SEARCH_REQUESTS,
            warmup_requests=0,
            show_progress=False,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
        ),
        objectives=objectives,
        shapes=tuple(args.shapes or placement.SEARCH_SHAPES),
        deployments_dir=args.deployments_dir,
        devices_per_node=args.devices_per_node,
        accelerator=args.target or "gpu",
        model=args.model,
        qps_start=args.qps_start,
        run_seconds=args.run_seconds,
    )
    slug = "".join(c if c.isalnum() else "-" for c in question.run.workload.label).strip("-")
    yaml_path = args.yaml or args.deployments_dir / f"advised-{slug}.yaml"
    advise_placement(question, out, yaml_path, console)
    return 0


def _advised_workload(args: argparse.Namespace) -> WorkloadConfig:
    """--workload, a trace, or --input-len/--output-len's fixed lengths."""
    name = args.workload
    if args.trace is not None:
        name = "recorded-replay" if args.trace == "recorded" else "T-burst-replay"
    elif args.input_len or args.output_len:
        name = "custom"
    return WorkloadConfig(
        name=name,
        input_len=args.input_len,
        output_len=args.output_len,
        trace=args.trace or "burstgpt",
        trace_file=args.trace_file,
    )


def _simulated_sweep(args: argparse.Namespace, runs_dir: Path, console: Console) -> None:
    """The smoke sweep's cells, each run offline on the profile (python -m loadgen
    simulate), written where a sweep writes its runs."""
    workload = WorkloadConfig(name=args.workload, trace=args.trace or "burstgpt")
    rates = [_rate(text) for text in str(args.qps).split(",")]

    async def cells() -> None:
        for shape in args.shapes:
            target = SimulatedTarget(str(args.deployments_dir / f"{shape}.yaml"), args.simulate)
            for qps in rates:
                config = RunConfig(
                    workload=workload,
                    qps=qps,
                    num_requests=args.num_requests,
                    warmup_requests=0,
                    shape=shape,
                    show_progress=False,
                    slo_ttft_ms=args.slo_ttft_ms,
                    slo_tpot_ms=args.slo_tpot_ms,
                )
                result = await simulate_run(config, target, console)
                console.print(f"{result.run_id}: {result.notes[0]}")
                write_run_json(result, runs_dir)

    run_event_loop(cells())


def _rate(text: str) -> float:
    return math.inf if text.strip() == "inf" else float(text)


def _advise_sweep_argv(args: argparse.Namespace, folder: Path) -> list[str]:
    argv = [
        "--shapes", ",".join(args.shapes), "--workloads", args.workload, "--qps", args.qps,
        "--num-requests", str(args.num_requests), "--warmup-requests", "2",
        "--out", str(folder), "--no-plots", "--no-progress",
        "--deployments-dir", str(args.deployments_dir),
    ]  # fmt: skip
    if args.trace:
        argv += ["--trace", args.trace]
    if args.trace_file:
        argv += ["--trace-file", str(args.trace_file)]
    return argv


def _model_dims(model: str | None, console: Console) -> ModelDims | None:
    """The model's heads and weight size, where its config.json can be read here."""
    if model is None:
        return None
    config = read_model_config(model)
    if config is None:
        console.print(f"{model}: no config.json here (nothing is downloaded); TP not sized")
        return None
    return model_dims(config)
